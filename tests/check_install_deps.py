"""Fails when scripts/install-deps.sh does not install a Debian package that the build needs.

A fresh machine has only what install-deps.sh installs, so every dependency that the Meson files
require must come from a package in its list. This check reads the required dependencies from
Meson's own introspection of the source tree (a feature option that is not 'disabled' counts as
required: kolo builds with it wherever it is found), and the required programs from the
`find_program(...)` calls in every meson.build, and the Python modules that `pip install .` needs
(pyproject.toml's build backend; venv's ensurepip and pip, which tests/python/check_pip_install.py
uses with Debian's interpreter). For each it finds the file that provides it on
this machine (the pkg-config file, a CMake package file, the program in Debian's directories, or the module's
file as Debian's /usr/bin/python3 imports it)
and asks dpkg which package owns that file.

Usage: check_install_deps.py [--self-test] SOURCE_ROOT [INSTALL_DEPS_SCRIPT]
--self-test also checks that taking any one listed package out of the list is noticed.
Exit 0 when every dependency's package is listed, 1 naming each one that is not.
"""
import glob
import json
import os
import re
import subprocess
import sys

# Dependencies that Meson satisfies from the compiler itself, with no package of their own.
BUILT_IN_DEPENDENCIES = {"threads", "dl", "openmp"}
# Where Debian puts programs; PATH may hold other interpreters (pyenv) that a fresh machine lacks.
DEBIAN_PROGRAM_DIRS = ["/usr/bin", "/usr/sbin", "/bin", "/sbin"]
CMAKE_PACKAGE_DIRS = ["/usr/lib/cmake", "/usr/share/cmake", "/usr/lib/*/cmake", "/usr/share/*/cmake"]


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def required_dependencies(source_root):
    result = run(["meson", "introspect", "--dependencies", os.path.join(source_root, "meson.build")])
    if result.returncode != 0:
        sys.exit(f"meson introspect failed:\n{result.stderr}")
    names = [entry["name"] for entry in json.loads(result.stdout) if entry["required"]]
    return sorted(set(names) - BUILT_IN_DEPENDENCIES)


FIND_PROGRAM = re.compile(r"find_program\(([^()]*(?:\([^()]*\)[^()]*)*)\)", re.S)
REQUIRED_FALSE = re.compile(r"required\s*:\s*false")


def meson_files(source_root):
    """Every meson.build of the source tree, passing over .git and build folders."""
    for folder, subfolders, files in os.walk(source_root):
        subfolders[:] = sorted(name for name in subfolders if name != ".git"
                               and not os.path.exists(os.path.join(folder, name, "meson-private")))
        if "meson.build" in files:
            yield os.path.join(folder, "meson.build")


def required_programs(source_root):
    """(meson.build, program) for each find_program call without `required : false`."""
    programs = []
    for meson_file in meson_files(source_root):
        text = open(meson_file).read()
        for call in FIND_PROGRAM.finditer(text):
            arguments = call.group(1)
            if REQUIRED_FALSE.search(arguments):
                continue
            first = re.match(r"\s*'([^']+)'", arguments)
            if not first:
                continue  # a computed path: nothing to look up by name
            name = first.group(1)
            # A script of the project's own is found in its source folder, not installed.
            if os.path.exists(os.path.join(os.path.dirname(meson_file), name)):
                continue
            programs.append((os.path.relpath(meson_file, source_root), name))
    return programs


def owning_package(path):
    result = run(["dpkg", "-S", path])
    if result.returncode != 0:
        result = run(["dpkg", "-S", os.path.realpath(path)])
    if result.returncode != 0:
        return None
    # "libfmt-dev:amd64: /usr/lib/..." -> "libfmt-dev"
    return result.stdout.splitlines()[0].split(":")[0].split(",")[0].strip()


def installed_depends():
    """{package: the packages it depends on} for every package installed on this machine."""
    result = run(["dpkg-query", "-W", "-f=${Package}\t${Pre-Depends}, ${Depends}\n"])
    graph = {}
    for line in result.stdout.splitlines():
        package, _, depends = line.partition("\t")
        # "a (>= 1), b | c" -> a, b: the first choice of each alternative is what apt installs.
        graph[package] = [clause.split("|")[0].split("(")[0].split(":")[0].strip()
                          for clause in depends.split(",") if clause.strip()]
    return graph


def closure(packages, graph):
    """The packages that apt installs for `packages`: them and what they depend on."""
    seen, pending = set(), list(packages)
    while pending:
        package = pending.pop()
        if package not in seen:
            seen.add(package)
            pending.extend(graph.get(package, []))
    return seen


def dependency_file(name):
    result = run(["pkg-config", "--path", name])
    if result.returncode == 0 and result.stdout.strip():
        return result.stdout.strip()
    for pattern in CMAKE_PACKAGE_DIRS:
        for directory in glob.glob(pattern):
            for config in (f"{name}Config.cmake", f"{name.lower()}-config.cmake"):
                found = glob.glob(os.path.join(directory, "*", config))
                if found:
                    return found[0]
    return None


def program_file(name):
    if os.path.isabs(name):
        return name if os.path.exists(name) else None
    for directory in DEBIAN_PROGRAM_DIRS:
        candidate = os.path.join(directory, name)
        if os.path.exists(candidate):
            return candidate
    return None


# Modules of Debian's interpreter that the pip route needs beside pyproject.toml's build backend:
# `python3 -m venv` makes a venv with pip only where ensurepip is installed (python3-venv).
PIP_ROUTE_MODULES = ["ensurepip", "pip"]


def required_python_modules(source_root):
    """(where, module) for pyproject.toml's build backend and the pip route's modules."""
    pyproject = os.path.join(source_root, "pyproject.toml")
    if not os.path.exists(pyproject):
        return []
    match = re.search(r"^build-backend\s*=\s*['\"]([\w.]+)['\"]", open(pyproject).read(), re.M)
    backend = [("pyproject.toml", match.group(1).split(".")[0])] if match else []
    return backend + [("tests/python/check_pip_install.py", module) for module in PIP_ROUTE_MODULES]


def module_file(name):
    result = run(["/usr/bin/python3", "-c",
                  "import importlib.util, sys; spec = importlib.util.find_spec(sys.argv[1]); "
                  "print(spec.origin if spec else '')", name])
    path = result.stdout.strip() if result.returncode == 0 else ""
    return path or None


def resolve(source_root):
    """(kind, where, name, file or None, package or None) for every required dependency and program."""
    wanted = [("dependency", "meson.build files", name, dependency_file(name))
              for name in required_dependencies(source_root)]
    wanted += [("program", where, name, program_file(name)) for where, name in required_programs(source_root)]
    wanted += [("Python module", where, name, module_file(name))
               for where, name in required_python_modules(source_root)]
    return [(kind, where, name, path, owning_package(path) if path else None)
            for kind, where, name, path in wanted]


def check(resolved, listed, graph, script_name):
    """Lines for the dependencies whose package the list installs, and for those it does not."""
    installed = closure(listed, graph)
    checked, problems = [], []
    for kind, where, name, path, package in resolved:
        if path is None:
            problems.append(f"{kind} '{name}' ({where}) is not found on this machine, so its "
                            "package cannot be told: install it and name its package in install-deps.sh")
        elif package is None:
            problems.append(f"{kind} '{name}' ({where}) is provided by {path}, which no Debian "
                            "package owns")
        elif package not in installed:
            problems.append(f"{kind} '{name}' ({where}) comes from the Debian package '{package}' "
                            f"({path}), which {script_name} does not install")
        else:
            checked.append(f"{kind} {name}: {package}")
    return checked, problems


def self_test(resolved, listed, graph, script_name):
    """The check must notice each needed package taken out of the list, one at a time, by name."""
    failures = 0
    for package in sorted({entry[4] for entry in resolved if entry[4] in listed}):
        if package in closure(listed - {package}, graph):
            continue  # another listed package brings it in
        _, problems = check(resolved, listed - {package}, graph, script_name)
        if not any(f"'{package}'" in problem for problem in problems):
            print(f"FAIL without '{package}' in the list, the check expected a failure naming it, got {problems}")
            failures += 1
    print(f"self-test: {failures} of the listed packages went unnoticed when taken out")
    return failures


def main():
    arguments = [argument for argument in sys.argv[1:] if argument != "--self-test"]
    source_root = arguments[0]
    script = arguments[1] if len(arguments) > 1 else os.path.join(source_root, "scripts", "install-deps.sh")
    script_name = os.path.basename(script)
    listing = run(["sh", script, "--list"])
    if listing.returncode != 0:
        sys.exit(f"{script} --list failed:\n{listing.stderr}")
    listed = set(listing.stdout.split())

    resolved = resolve(source_root)
    graph = installed_depends()
    checked, problems = check(resolved, listed, graph, script_name)
    for line in checked:
        print("ok  ", line)
    for line in problems:
        print("FAIL", line)
    if "--self-test" in sys.argv and self_test(resolved, listed, graph, script_name):
        return 1
    if problems:
        print(f"{len(problems)} required dependencies are missing from {script}")
        return 1
    print(f"all {len(checked)} required dependencies and programs come from packages that "
          f"{script_name} installs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
