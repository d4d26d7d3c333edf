"""`pip install .` into a fresh virtual environment, then a 2-rank kolo.torch job from it.

The environment is made with Debian's interpreter and --system-site-packages (numpy and torch
come from Debian), and pip builds with --no-build-isolation --no-index (no Python index is
reachable; Debian's python3-mesonpy is the backend). meson-python builds in BUILD_DIR/pip-build,
a fixed folder, so that ccache and Ninja find what the last run compiled. The job runs with no
KOLO_LIBRARY and no PYTHONPATH, from a scratch folder, under the environment's own kolorun: kolo
must load the libkolo.so inside the installed package, and an allreduce must give the sum that
this script computes itself.
Usage: check_pip_install.py BUILD_DIR SOURCE_ROOT. Exit 0 when it all holds, 1 saying what did not.
"""
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile

JOB = r'''
import os, sys
import torch
import kolo, kolo.torch as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
tensor = torch.arange(5, dtype=torch.float64) * (rank + 1)
summed = hvd.allreduce(tensor, op=hvd.Sum)
print(f"rank {rank} of {size}: {summed.tolist()} library {kolo.library_path} "
      f"version {hvd.__version__} torch-module {hvd.__file__}", flush=True)
hvd.shutdown()
'''


def run(command, timeout, **kwargs):
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def fail(message, result=None):
    if result is not None:
        print(result.stdout[-6000:], result.stderr[-6000:], sep="\n")
    print(f"FAIL: {message}")
    return 1


def project_version(source_root):
    text = open(os.path.join(source_root, "meson.build")).read()
    return re.search(r"version\s*:\s*'([0-9.]+)'", text).group(1)


def main():
    build_dir, source_root = (os.path.abspath(path) for path in sys.argv[1:3])
    version = project_version(source_root)
    venv = os.path.join(build_dir, "pip-venv")
    shutil.rmtree(venv, ignore_errors=True)
    result = run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], 120)
    if result.returncode != 0:
        return fail("python3 -m venv failed (Debian's python3-venv?)", result)
    python = os.path.join(venv, "bin", "python")
    env = {key: value for key, value in os.environ.items()
           if key not in ("KOLO_LIBRARY", "PYTHONPATH")}
    # meson-python reconfigures a build folder it is given when the native file it left in the
    # source tree names this interpreter, and `meson setup --reconfigure` refuses a folder that
    # holds no build yet: then the stale native file goes, and meson-python sets up afresh.
    pip_build = os.path.join(build_dir, "pip-build")
    if not os.path.exists(os.path.join(pip_build, "meson-private", "coredata.dat")):
        native_file = os.path.join(source_root, ".mesonpy-native-file.ini")
        if os.path.exists(native_file):
            os.remove(native_file)
    result = run([python, "-m", "pip", "install", "--no-build-isolation", "--no-index",
                  "--config-settings=builddir=" + pip_build,
                  "--config-settings=compile-args=-j2", source_root], 1500, env=env)
    if result.returncode != 0:
        return fail("pip install . failed", result)
    kolorun = os.path.join(venv, "bin", "kolorun")
    if not os.access(kolorun, os.X_OK):
        return fail(f"pip install . put no kolorun into {os.path.dirname(kolorun)}")
    result = run([kolorun, "--version"], 30, env=env)
    if result.stdout.strip() != f"kolorun (kolo) {version}":
        return fail(f"kolorun --version: expected 'kolorun (kolo) {version}'", result)

    with tempfile.TemporaryDirectory(prefix="kolo-pip-job-") as scratch:
        script = os.path.join(scratch, "job.py")
        with open(script, "w") as file:
            file.write(JOB)
        env.update({"KOLO_TRANSPORT": "tcp", "KOLO_DEBUG": "INFO", "KOLO_TIMEOUT": "60"})
        result = run([kolorun, "-np", "2", python, script], 180, env=env, cwd=scratch)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        return fail(f"the 2-rank job exited {result.returncode}", result)
    site = os.path.realpath(venv)
    for rank in range(2):
        # Each rank adds arange(5) * (rank + 1): the sum is arange(5) * 3.
        expected = [float(3 * i) for i in range(5)]
        line = re.search(rf"rank {rank} of 2: (\[[^]]*\]) library (\S+) version (\S+) "
                         rf"torch-module (\S+)", output)
        if not line:
            return fail(f"rank {rank} printed no result", result)
        if ast.literal_eval(line.group(1)) != expected:
            return fail(f"rank {rank}: allreduce gave {line.group(1)}, expected {expected}")
        for what, path in (("libkolo", line.group(2)), ("kolo.torch", line.group(4))):
            if not os.path.realpath(path).startswith(site + os.sep):
                return fail(f"rank {rank} loaded {what} from {path}, not from {venv}")
        if line.group(3) != version:
            return fail(f"kolo.torch.__version__ is {line.group(3)}, meson.build says {version}")
    if len(re.findall(rf"kolo {re.escape(version)} \(commit ", output)) != 1:
        return fail("expected one start-up line 'kolo VERSION (commit ...' from rank 0", result)
    print(output)
    print("pip install . in a fresh venv, then a 2-rank kolo.torch job from it: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
