"""Fails when `meson install` installs another set of files of the Python package `kolo` than
the source tree holds (a module left out of the install, or a stray file put in).

Installs the build into a scratch --destdir and compares the files under its kolo/ with the
files under python/kolo/ that git tracks (all files there outside git), leaving out
__pycache__; kolo/_install.py.in is installed as kolo/_install.py. Where the build's prefix is
under /usr (the default /usr/local, or /usr), the folder the package lands in must also be on
Debian's interpreter's sys.path, so that the installed `import kolo` works without PYTHONPATH.
Usage: check_installed_files.py BUILD_DIR SOURCE_ROOT. Exit 0 when equal, 1 naming each file
that differs."""
import os
import subprocess
import sys
import tempfile


def package_files(root):
    found = set()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "__pycache__"]
        for name in files:
            found.add(os.path.relpath(os.path.join(folder, name), root))
    return found


def source_files(source_root):
    package = os.path.join(source_root, "python", "kolo")
    listed = subprocess.run(["git", "-C", package, "ls-files", "--full-name", "."],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        return package_files(package)
    prefix = "python/kolo/"
    return {name[len(prefix):] for name in listed.stdout.split() if name.startswith(prefix)}


def main():
    build_dir, source_root = sys.argv[1], sys.argv[2]
    expected = {("_install.py" if name == "_install.py.in" else name)
                for name in source_files(source_root)}
    with tempfile.TemporaryDirectory(prefix="kolo-install-") as destdir:
        result = subprocess.run(["meson", "install", "-C", build_dir, "--no-rebuild", "--quiet",
                                 "--destdir", destdir], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"meson install failed:\n{result.stdout}{result.stderr}")
            return 1
        packages = [folder for folder, subfolders, _ in os.walk(destdir)
                    if os.path.basename(folder) in ("dist-packages", "site-packages")
                    and "kolo" in subfolders]
        if len(packages) != 1:
            print(f"expected one installed kolo package under {destdir}, found {packages}")
            return 1
        installed = package_files(os.path.join(packages[0], "kolo"))
        site = "/" + os.path.relpath(packages[0], destdir)
    problems = 0
    if site.startswith("/usr/"):
        path = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('\\n'.join(sys.path))"],
                              capture_output=True, text=True).stdout.split("\n")
        if site not in path:
            print(f"kolo is installed into {site}, which /usr/bin/python3 does not search "
                  f"(its sys.path: {[entry for entry in path if entry]})")
            problems += 1
        else:
            print(f"kolo is installed into {site}, on /usr/bin/python3's sys.path")
    missing = sorted(expected - installed)
    extra = sorted(installed - expected)
    for name in missing:
        print(f"python/kolo/{name} is in the source tree but not installed (python/meson.build)")
    for name in extra:
        print(f"kolo/{name} is installed but is not a file of python/kolo in the source tree")
    if missing or extra or problems:
        return 1
    print(f"the {len(installed)} installed files of kolo are the source tree's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
