"""Partition sources of training and the swap file's lease: a reader of a swap file waits for
its write, or learns that its writer died."""

import os
import socket
import subprocess
import sys

import pytest

from pbg_ray.errors import PbgRayError
from pbg_ray.training.bucket_sources import WriterDied, wait_written, written_marker


def test_a_reader_of_a_swap_file_waits_for_its_write_or_learns_it_never_ends(tmp_path):
    staged = str(tmp_path / ".partition.h5.tmp-swap-x-0")
    marker = written_marker(staged)
    marker.write_text("tok\ndone")
    wait_written(staged, "tok")
    with pytest.raises(WriterDied, match="does not hold the values of lease other"):
        wait_written(staged, "other")
    marker.write_text("tok\nfailed writing x: disk full")
    with pytest.raises(PbgRayError, match="writing x: disk full"):
        wait_written(staged, "tok")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    marker.write_text(f"tok\npending {socket.gethostname()} {gone}")
    with pytest.raises(WriterDied, match="died before the write was done"):
        wait_written(staged, "tok")
    marker.write_text(f"tok\npending {socket.gethostname()} {os.getpid()}")  # alive: waits
    with pytest.raises(WriterDied, match="did not finish in 0 s"):
        wait_written(staged, "tok", timeout=0.05)
