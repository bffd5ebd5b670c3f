"""Long silent waits say how far they are: a vLLM server's start-up (its newest log line), a checkpoint's checksums
(GiB done), the Hub upload's secret scan (files scanned). Driven by an injected clock: nothing here waits."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

from trlx_scale.progress_notice import PeriodicNotice


def stepping_clock(step: float):
    """A clock that moves ``step`` seconds at every reading."""
    counter = itertools.count()
    return lambda: next(counter) * step


def test_a_notice_reports_once_per_interval_with_the_elapsed_time():
    now = [0.0]
    lines: list[str] = []
    notice = PeriodicNotice("waiting", every=10.0, clock=lambda: now[0], report=lines.append)
    for now[0] in (3.0, 9.9):
        notice.tick(lambda elapsed: f"{elapsed:.1f} s")
    assert lines == []  # a wait shorter than the interval prints nothing
    for now[0] in (10.0, 15.0, 19.9, 20.0):
        notice.tick(lambda elapsed: f"{elapsed:.1f} s")
    assert lines == ["waiting: 10.0 s", "waiting: 20.0 s"]


class _FakeLaunch:
    """A 'server' that logs a line, waits until the test has seen it (a file appears), then exits with code 3."""

    def __init__(self, release_file: str):
        self.model, self.url = "my-model", "http://127.0.0.1:9"  # port 9 (discard): nothing answers /health
        self.release_file = release_file

    def arguments(self) -> list[str]:
        script = (
            "import os, sys, time\n"
            "print('loading weights: shard 3 of 7', flush=True)\n"
            f"while not os.path.exists({self.release_file!r}): time.sleep(0.01)\n"
            "sys.exit(3)\n"
        )
        return [sys.executable, "-c", script]

    def environment(self) -> dict:
        return dict(os.environ)


def test_a_server_start_up_says_how_long_it_has_waited_and_its_newest_log_line(tmp_path):
    from trlx_scale.generation.vllm_server import VLLMServerProcess, VLLMServerStartError

    release = tmp_path / "seen"
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        if "shard 3 of 7" in line:
            release.touch()  # the line reached the user: let the fake server go on (and exit)

    server = VLLMServerProcess(_FakeLaunch(str(release)), startup_timeout=600, bound_to_parent=False)
    server.progress = PeriodicNotice("vLLM server for my-model", every=10.0, clock=stepping_clock(10.0), report=report)
    with pytest.raises(VLLMServerStartError, match="exited with code 3 during start-up"):
        server.start()
    assert any(line.startswith("vLLM server for my-model: starting for ") for line in lines)
    assert lines[-1].endswith("its log says: loading weights: shard 3 of 7")


def test_checksums_of_a_large_share_say_how_far_they_are(tmp_path):
    from trlx_scale.reliability.checkpoint_integrity import hash_share

    (tmp_path / "a.bin").write_bytes(b"x" * 3000)
    lines: list[str] = []
    notice = PeriodicNotice("checksums", every=1.0, clock=stepping_clock(1.0), report=lines.append)
    digests = hash_share(str(tmp_path), {"a.bin": 3000}, rank=0, world_size=1, piece_bytes=1000, progress=notice)
    assert len(digests) == 3
    assert [line.split(" of ")[0] for line in lines] == ["checksums: 33%", "checksums: 67%", "checksums: 100%"]


def test_the_secret_scan_says_how_many_files_it_has_scanned(tmp_path):
    from trlx_scale.hub.secrets import files_with_secrets

    for index in range(4):
        (tmp_path / f"file{index}.txt").write_text("hf_secret" if index == 2 else "nothing")
    lines: list[str] = []
    notice = PeriodicNotice("scan", every=1.0, clock=stepping_clock(1.0), report=lines.append)
    assert files_with_secrets(str(tmp_path), ["hf_secret"], progress=notice) == ["file2.txt"]
    assert [line.split(" in ")[0] for line in lines] == [f"scan: {n} files scanned" for n in (1, 2, 3, 4)]
