"""Recipes: checked configurations for real models and GPU counts (``trlx-scale recipes`` lists them).

Each recipe is one YAML file in this folder: a ``recipe`` block (what it is for, its hardware, the Accelerate config,
the model's shape for the planner, the memory the planner expects per GPU, the dataset columns it needs) and a
``config`` block of script arguments and config fields, as ``trlx-scale <command> --config FILE`` reads them
(``--recipe NAME`` finds a shipped one). ``catalog`` reads them; ``trlx_scale.recipe_check`` verifies each against
the planner and the trainer's config.
"""

from .catalog import Recipe, load_recipe, recipe_names

__all__ = ["Recipe", "load_recipe", "recipe_names"]
