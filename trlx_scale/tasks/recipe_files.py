"""``--recipe NAME`` and ``--config RECIPE.yaml`` on a training script's command line: the recipe's ``config`` block
becomes the script's defaults (the command line still overrides them)."""

from __future__ import annotations

from typing import Any

from ..recipes.catalog import is_recipe, load_recipe


def recipe_arguments(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(``argv`` without the recipe flag, the recipe's config values); a plain ``--config`` file stays TRL's."""
    argv = list(argv)
    if "--recipe" in argv:
        index = argv.index("--recipe")
        if index + 1 >= len(argv):
            raise ValueError("--recipe needs a name (`trlx-scale recipes` lists them) or a recipe file.")
        name = argv[index + 1]
        del argv[index : index + 2]
        return argv, load_recipe(name).config
    if "--config" in argv:
        import yaml

        index = argv.index("--config")
        if index + 1 < len(argv):
            with open(argv[index + 1]) as handle:
                document = yaml.safe_load(handle)
            if is_recipe(document):
                path = argv[index + 1]
                del argv[index : index + 2]
                return argv, load_recipe(path).config
    return argv, {}
