import json
import subprocess
import sys


def test_cycle_goes_back_and_forth_and_status_reads_the_result(tmp_path):
    state = tmp_path / "gpus.json"
    r = subprocess.run([sys.executable, "-m", "fake_gpu", "--state-file", str(state), "cycle", "--from", "0", "--to", "3",
                        "--times", "2", "--interval", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert [line.split(": ", 1)[0] + ": " + line.rsplit(": ", 1)[1] for line in r.stdout.splitlines()] == ["cycle 1/2: 3 fake GPUs", "cycle 1/2: 0 fake GPUs",
                                     "cycle 2/2: 3 fake GPUs", "cycle 2/2: 0 fake GPUs"]
    r = subprocess.run([sys.executable, "-m", "fake_gpu", "--state-file", str(state), "status"],
                       capture_output=True, text=True, timeout=30)
    assert json.loads(r.stdout)["count"] == 0


def test_status_of_a_missing_file_fails_with_a_hint(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fake_gpu", "--state-file", str(tmp_path / "none.json"), "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "fake-gpu set --count" in r.stderr
