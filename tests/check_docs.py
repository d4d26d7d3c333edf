#!/usr/bin/env python3
"""Docs that cannot rot: runs every runnable snippet of README.md and docs/*.md, checks that
every environment variable kolo reads and every function kolo.h exports is documented, and that
every relative link leads to a file and heading that exist.

Usage: check_docs.py SOURCE_ROOT BUILD_DIR [--self-test] [--verbose] [FILE.md ...]

A fenced block runs when its info string is exactly one of
  sh       a shell script (bash -e), run from the repository root, where build/ holds the build;
  c, cpp   a whole program, compiled against capi/kolo.h and BUILD_DIR/capi/libkolo.so, then run
           as 2 ranks under BUILD_DIR/src/kolorun;
  python   a script run as 2 ranks under kolorun by /usr/bin/python3, with PYTHONPATH=python
           and KOLO_LIBRARY set.
Any other info string (`sh norun`, `python norun`, `text`, `cmake`, ...) is not run. A block
whose info string is `LANG example=PATH` is a file that tests run as it is (docs/several-hosts.md's
job scripts, which need the namespace cluster): it is not run here, but its text must be
byte-identical to PATH (relative to the repository root). A shell
block that installs packages or runs the whole test suite (apt-get, scripts/test.sh,
scripts/bench.sh, ...) is recognised, reported and skipped: it takes far longer than this test.
A shell block may start at most 4 ranks (-np, --np, --nproc_per_node).

The variables: the KOLO_* names in src/core/config.cpp's table (kKnownVariables), the ones that
python/kolo reads (os.environ) or kolorun and the benchmarks read or set (getenv, setenv,
os.environ, $KOLO_... in shell) must each be a row of docs/environment.md's table exactly once,
and every row must name one of them. The functions: every `KOLO_API ... kolo_name(` declaration
of capi/kolo.h must be named in some page of docs/.

Links: a relative link must name a file that exists, or a page that docs/README.md's index lists
(another change may still be writing it: reported as a note), and its #anchor a heading of that
page (GitHub's anchors). README.md stays under README_MAX_LINES lines.

--verbose prints what each snippet printed. --self-test checks the checker on broken inputs (a
failing snippet of each language, a hanging one, too many ranks, a variable left out of the
table or listed twice, a broken link) and exits 0 only when it catches each.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RUNNABLE = {"sh", "c", "cpp", "python"}
SKIPPED = "skipped"  # what Runner.check returns for a block it recognised and did not run
SNIPPET_TIMEOUT_S = 90  # one snippet, compile and run; the whole run is kept to a minute or two
MAX_RANKS = 4
NESTED = "CHECK_DOCS_NESTED"
DEBIAN_PYTHON = "/usr/bin/python3"

# A shell block that installs or runs the whole suite: recognised and skipped, never run here.
INSTALL_OR_SUITE = re.compile(
    r"(^|[\s;&|(])(apt-get|apt|dpkg|sudo|pip3?|python3 -m pip)\s|"
    r"scripts/(test|bench|install-deps|fresh-machine|sanitize)\.sh|"
    r"(^|\s)\.ci/run|"
    r"meson test -C \S+\s*($|[;&|]|--(num-processes|print-errorlogs)\b)")
# The rank count a launcher is given: its options up to the first that names the count.
RANKS = re.compile(r"\b(?:kolorun|mpirun|mpiexec|srun|torchrun|torch\.distributed\.run)\b"
                   r"(?:\s+(?!-np\b|--np\b|-n\b|--ntasks\b|--nproc[_-]per[_-]node\b)-[-\w]+"
                   r"(?:[ =](?!-)\S+)?)*"
                   r"\s+(?:-np|--np|-n|--ntasks|--nproc[_-]per[_-]node)[ =](\d+)")


class Snippet:
    def __init__(self, path, line, lang, text):
        self.path, self.line, self.lang, self.text = path, line, lang, text

    def where(self):
        return f"{self.path}:{self.line}"


def fenced_blocks(path, text):
    """Every fenced block of a Markdown text: (line of the fence, info string, body)."""
    blocks = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.groups()
        body = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and
                                      lines[j].strip().strip(fence[0]) == ""):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: a fenced block that never closes")
        blocks.append((i + 1, info.strip(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def snippets_of(path, text):
    return [Snippet(path, line, info, body) for line, info, body in fenced_blocks(path, text)
            if info in RUNNABLE]


def check_examples(root, path, text):
    """Problems with the `LANG example=PATH` blocks of a page: each must equal the file it names."""
    problems = []
    for line, info, body in fenced_blocks(path, text):
        match = re.match(r"^\w+\s+example=(\S+)$", info)
        if not match:
            continue
        example = os.path.join(root, match.group(1))
        if not os.path.isfile(example):
            problems.append(f"{path}:{line}: the example file {match.group(1)} does not exist")
        elif read(example) != body:
            problems.append(f"{path}:{line}: the block differs from {match.group(1)}, which the "
                            "tests run: copy the file into the page")
    return problems


def tail(text, lines=25):
    return "\n".join("    " + line for line in text.rstrip().split("\n")[-lines:])


class Runner:
    def __init__(self, root, build):
        self.root, self.build = root, build
        self.kolorun = os.path.join(build, "src", "kolorun")
        self.capi = os.path.join(build, "capi")
        self.env = dict(os.environ)
        self.env.pop("MALLOC_PERTURB_", None)  # meson test sets it; users do not have it
        self.env["PYTHONPATH"] = os.path.join(root, "python")
        self.env["KOLO_LIBRARY"] = os.path.join(self.capi, "libkolo.so")
        self.env.setdefault("KOLO_TIMEOUT", "60")  # every wait of a snippet bounded well inside
        self.env[NESTED] = "1"  # a snippet that runs this test again must not recurse
        self.last_output = ""

    def run(self, argv, cwd, stdin=None):
        """Runs argv in a session of its own; on the timeout every process of that session goes."""
        started = time.monotonic()
        process = subprocess.Popen(argv, cwd=cwd, env=self.env, text=True,
                                   stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            out, _ = process.communicate(stdin, timeout=SNIPPET_TIMEOUT_S)
            code = process.returncode
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # what a snippet left behind, too
            except ProcessLookupError:
                pass
        if code is None:
            out, _ = process.communicate()
        self.last_output = out or ""
        return code, self.last_output, time.monotonic() - started

    def check(self, snippet):
        """None when it ran and passed, SKIPPED when it was recognised and not run, else what
        went wrong."""
        if snippet.lang == "sh":
            return self.check_shell(snippet)
        with tempfile.TemporaryDirectory(prefix="kolo-docs-") as scratch:
            if snippet.lang in ("c", "cpp"):
                source = os.path.join(scratch, "snippet." + snippet.lang)
                program = os.path.join(scratch, "snippet")
                with open(source, "w") as out:
                    out.write(snippet.text)
                compiler = (["cc", "-std=c11"] if snippet.lang == "c" else ["c++", "-std=c++17"])
                argv = compiler + ["-Wall", "-Wextra", "-Werror", "-I", os.path.join(
                    self.root, "capi"), "-I", self.capi, source, "-o", program, "-L", self.capi,
                    "-lkolo", "-Wl,-rpath," + self.capi]
                code, out, _ = self.run(argv, scratch)
                if code != 0:
                    return f"does not compile ({' '.join(argv[:2])}):\n{tail(out)}"
                command = [program]
            else:
                script = os.path.join(scratch, "snippet.py")
                with open(script, "w") as out:
                    out.write(snippet.text)
                command = [DEBIAN_PYTHON, script]
            argv = [self.kolorun, "-np", "2", "--timeout", str(SNIPPET_TIMEOUT_S - 10)] + command
            code, out, seconds = self.run(argv, self.root)
            if code != 0:
                what = "timed out" if code in (None, 124) else f"exited {code}"
                return f"{what} after {seconds:.1f} s as 2 ranks under kolorun:\n{tail(out)}"
            return None

    def check_shell(self, snippet):
        if INSTALL_OR_SUITE.search(snippet.text):
            print(f"skip  {snippet.where()}: installs packages or runs the whole test suite")
            return SKIPPED
        for match in RANKS.finditer(snippet.text):
            if int(match.group(1)) > MAX_RANKS:
                return (f"starts {match.group(1)} ranks; a runnable example starts at most "
                        f"{MAX_RANKS} (mark it `sh norun` if it must show more)")
        if os.path.realpath(os.path.join(self.root, "build")) != os.path.realpath(self.build):
            print(f"skip  {snippet.where()}: shell snippets need the build in "
                  f"{self.root}/build, and it is in {self.build}")
            return SKIPPED
        code, out, seconds = self.run(["bash", "-e", "-o", "pipefail", "-s"], self.root,
                                      stdin=snippet.text)
        if code != 0:
            what = "timed out" if code is None else f"exited {code}"
            return f"{what} after {seconds:.1f} s (bash -e, from the repository root):\n{tail(out)}"
        return None


# ---- what the code reads, and what the docs say ---------------------------------------------

def read(path):
    with open(path, encoding="utf-8") as source:
        return source.read()


def files_under(folder, suffixes):
    for base, _, names in os.walk(folder):
        for name in sorted(names):
            if name.endswith(suffixes):
                yield os.path.join(base, name)


ENV_ACCESS = [
    re.compile(r'\b(?:getenv|setenv|unsetenv)\(\s*"(KOLO_[A-Z0-9_]+)"'),             # C, C++
    re.compile(r'environ(?:\.get|\.setdefault|\.pop)?\s*[\[(]\s*["\'](KOLO_[A-Z0-9_]+)'),  # Python
    re.compile(r'\$\{?(KOLO_[A-Z0-9_]+)'),                                            # shell
    re.compile(r'(?:^|[\s;])(?:export\s+)?(KOLO_[A-Z0-9_]+)='),                        # shell
]


def variables_in_code(root):
    """Every KOLO_* environment variable kolo reads or sets, with where it was found."""
    found = {}
    config = read(os.path.join(root, "src", "core", "config.cpp"))
    table = re.search(r"kKnownVariables\s*=\s*\{(.*?)\n\};", config, re.S)
    if not table:
        raise RuntimeError("src/core/config.cpp: kKnownVariables not found")
    for name in re.findall(r'\{\s*"(KOLO_[A-Z0-9_]+)"', table.group(1)):
        found.setdefault(name, "src/core/config.cpp (kKnownVariables)")
    sources = list(files_under(os.path.join(root, "python", "kolo"), (".py",)))
    sources.append(os.path.join(root, "src", "tools", "kolorun.cpp"))
    sources += list(files_under(os.path.join(root, "bench"), (".c", ".cpp", ".hpp", ".py", ".sh")))
    for path in sources:
        text = read(path)
        for pattern in ENV_ACCESS:
            for name in pattern.findall(text):
                found.setdefault(name, os.path.relpath(path, root))
    # python/kolo/_secret.py names the secret's variables in a tuple, read through it.
    secret = read(os.path.join(root, "python", "kolo", "_secret.py"))
    listed = re.search(r"SECRET_VARIABLES\s*=\s*\(([^)]*)\)", secret)
    if listed:
        for name in re.findall(r'"(KOLO_[A-Z0-9_]+)"', listed.group(1)):
            found.setdefault(name, "python/kolo/_secret.py")
    return found


ENV_ROW = re.compile(r"^\|\s*`(KOLO_[A-Z0-9_]+)`\s*\|")


def check_environment(root, text, path="docs/environment.md"):
    problems = []
    rows = {}
    for number, line in enumerate(text.split("\n"), 1):
        match = ENV_ROW.match(line)
        if match:
            rows.setdefault(match.group(1), []).append(number)
    code = variables_in_code(root)
    for name, where in sorted(code.items()):
        if name not in rows:
            problems.append(f"{path}: {name} (read in {where}) has no row in the table")
        elif len(rows[name]) > 1:
            problems.append(f"{path}: {name} has {len(rows[name])} rows (lines "
                            f"{', '.join(map(str, rows[name]))}); one each")
    for name in sorted(set(rows) - set(code)):
        problems.append(f"{path}:{rows[name][0]}: {name} is in the table but kolo does not read it")
    return problems, len(code)


def exported_functions(root):
    header = read(os.path.join(root, "capi", "kolo.h"))
    return sorted(set(re.findall(r"^KOLO_API\b[^(;]*?\b(kolo_\w+)\s*\(", header, re.M)))


def check_symbols(root, pages):
    text = "\n".join(read(page) for page in pages)
    missing = [name for name in exported_functions(root)
               if not re.search(r"\b" + re.escape(name) + r"\b", text)]
    problems = [f"docs/: {name} (exported by capi/kolo.h) is named on no page" for name in missing]
    if missing and not os.path.exists(os.path.join(root, "docs", "c-api.md")):
        problems.append("docs/c-api.md, the C API's page, does not exist yet")
    return problems


# ---- links between the pages -----------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 200


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(text):
    found = set()
    in_code = False
    for line in text.split("\n"):
        if re.match(r"^\s*(```|~~~)", line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def check_links(root, files):
    """Every relative link names a file that exists (or a page docs/README.md lists, which
    another change may still be writing) and, with #anchor, a heading of that page."""
    problems, notes = [], set()
    index = os.path.join(root, "docs", "README.md")
    listed = set(re.findall(r"\]\(([\w./-]+\.md)\)", read(index))) if os.path.exists(index) else set()
    for path in files:
        text = read(path)
        shown = os.path.relpath(path, root)
        body = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in LINK.findall(body):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            name, _, anchor = target.partition("#")
            where = os.path.normpath(os.path.join(os.path.dirname(path), name)) if name else path
            if not os.path.exists(where):
                page = os.path.relpath(where, os.path.join(root, "docs"))
                if page in listed:
                    notes.add(page)
                else:
                    problems.append(f"{shown}: the link ({target}) leads nowhere")
                continue
            if anchor and where.endswith(".md") and anchor not in anchors(read(where)):
                problems.append(f"{shown}: the link ({target}) names no heading of "
                                f"{os.path.relpath(where, root)}")
    readme = os.path.join(root, "README.md")
    if readme in files:
        count = read(readme).count("\n")
        if count > README_MAX_LINES:
            problems.append(f"README.md: {count} lines; the front door stays under "
                            f"{README_MAX_LINES} (the rest belongs in docs/)")
    return problems, sorted(notes)


# ---- the checker checking itself ------------------------------------------------------------

def self_test(root, build):
    runner = Runner(root, build)
    failures = []

    def expect(what, got_problem):
        print(("ok    " if got_problem else "FAIL  ") + "self-test: " + what)
        if not got_problem:
            failures.append(what)

    broken = {
        "a shell command that fails": ("sh", "true\nfalse\necho not reached\n"),
        "a C program that does not compile": ("c", "int main(void) { return undefined_name; }\n"),
        "a C program whose rank fails": (
            "c", "#include <kolo.h>\nint main(void) { return kolo_version() > 0 ? 3 : 0; }\n"),
        "a C++ program that fails": ("cpp", "#include <kolo.h>\nint main() { return 1; }\n"),
        "a Python script that raises": ("python", "import kolo\nkolo.no_such_function()\n"),
        "a shell example with 8 ranks": ("sh", "build/src/kolorun -np 8 true\n"),
        "a torchrun example with 5 ranks": (
            "sh", "python3 -m torch.distributed.run --redirects 1 --tee 1 --nproc_per_node 5 x\n"),
        "a snippet that runs this test again": (
            "sh", "python3 tests/check_docs.py . build README.md\n"),
    }
    for what, (lang, text) in broken.items():
        expect(what + " is reported",
               runner.check(Snippet("self-test.md", 1, lang, text)) not in (None, SKIPPED))
    global SNIPPET_TIMEOUT_S
    saved, SNIPPET_TIMEOUT_S = SNIPPET_TIMEOUT_S, 3
    began = time.monotonic()
    problem = runner.check(Snippet("self-test.md", 1, "sh", "sleep 60 &\nsleep 60\n"))
    SNIPPET_TIMEOUT_S = saved
    expect("a snippet that hangs is stopped at the timeout, with what it started",
           problem is not None and "timed out" in problem and time.monotonic() - began < 10)
    counted = [RANKS.findall(line) for line in (
        "build/src/kolorun -np 2 build/bench/all_reduce_perf -b 8 -e 1M -n 200",
        "build/src/kolorun --timeout 9 -np 3 x", "mpirun --bind-to none -np 4 x", "x -n 500")]
    expect("ranks are counted from the launcher's options, not the program's",
           counted == [["2"], ["3"], ["4"], []])
    expect("a passing C program passes", runner.check(Snippet("self-test.md", 1, "c", (
        "#include <kolo.h>\n#include <stdio.h>\n"
        "int main(void) { printf(\"%d\\n\", kolo_version()); return 0; }\n"))) is None)
    expect("an apt-get block is skipped, not run",
           runner.check(Snippet("self-test.md", 1, "sh", "apt-get install -y nothing\nfalse\n"))
           == SKIPPED)
    blocks = snippets_of("self-test.md", "```sh norun\nfalse\n```\n```text\nx\n```\n```sh\ntrue\n```\n")
    expect("only exactly `sh` runs, not `sh norun` or `text`", [b.line for b in blocks] == [7])

    with tempfile.TemporaryDirectory(prefix="kolo-docs-") as scratch:
        with open(os.path.join(scratch, "job.sh"), "w") as out:
            out.write("srun hostname\n")
        expect("an example block equal to its file passes",
               not check_examples(scratch, "p.md", "```sh example=job.sh\nsrun hostname\n```\n"))
        expect("an example block that differs from its file is reported",
               check_examples(scratch, "p.md", "```sh example=job.sh\nsrun -N 2 hostname\n```\n"))
        expect("an example block whose file is missing is reported",
               check_examples(scratch, "p.md", "```sh example=gone.sh\ntrue\n```\n"))

    table = read(os.path.join(root, "docs", "environment.md"))
    problems, _ = check_environment(root, table)
    expect("docs/environment.md as it is passes", not problems)
    without = "\n".join(line for line in table.split("\n")
                        if not line.startswith("| `KOLO_TIMEOUT`"))
    problems, _ = check_environment(root, without)
    expect("a variable left out of the table is reported",
           any("KOLO_TIMEOUT" in problem for problem in problems))
    twice = table + "\n| `KOLO_SHM` | `auto` | again |\n"
    problems, _ = check_environment(root, twice)
    expect("a variable listed twice is reported", any("KOLO_SHM has 2" in p for p in problems))
    stale = table + "\n| `KOLO_NOT_READ_ANYWHERE` | `1` | stale |\n"
    problems, _ = check_environment(root, stale)
    expect("a variable kolo does not read is reported",
           any("KOLO_NOT_READ_ANYWHERE" in problem for problem in problems))
    with tempfile.TemporaryDirectory(prefix="kolo-docs-") as scratch:
        os.makedirs(os.path.join(scratch, "docs"))
        with open(os.path.join(scratch, "docs", "README.md"), "w") as out:
            out.write("# Index\n\n[a](a.md) [later](later.md)\n")
        with open(os.path.join(scratch, "docs", "a.md"), "w") as out:
            out.write("# A page\n\n## Its part: one\n\n[ok](#its-part-one) [gone](#no-such-part)"
                      " [missing](missing.md) [up](../README.md)\n```sh\n# not a heading\n```\n")
        with open(os.path.join(scratch, "README.md"), "w") as out:
            out.write("# kolo\n" + "line\n" * (README_MAX_LINES + 1))
        files = [os.path.join(scratch, name) for name in ("README.md", "docs/a.md", "docs/README.md")]
        problems, notes = check_links(scratch, files)
        expect("a link to a heading that does not exist is reported",
               any("#no-such-part" in problem for problem in problems))
        expect("a link to a page that exists nowhere is reported",
               any("missing.md" in problem for problem in problems))
        expect("a page the index lists but nobody wrote yet is a note, not a failure",
               notes == ["later.md"] and not any("later.md" in p for p in problems))
        expect("a link to an existing heading passes",
               not any("its-part-one" in problem for problem in problems))
        expect("a README over the line limit is reported",
               any("README.md:" in problem and "lines" in problem for problem in problems))
    return 1 if failures else 0


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    if os.environ.get(NESTED):
        print("check_docs: run from one of its own snippets; skipped")
        return 77
    root, build = os.path.abspath(argv[1]), os.path.abspath(argv[2])
    rest = argv[3:]
    verbose = "--verbose" in rest
    rest = [arg for arg in rest if arg != "--verbose"]
    if "--self-test" in rest:
        return self_test(root, build)
    docs = os.path.join(root, "docs")
    pages = sorted(os.path.join(docs, name) for name in os.listdir(docs) if name.endswith(".md"))
    files = [os.path.abspath(name) for name in rest] or [os.path.join(root, "README.md")] + pages
    for tool in ("cc", "c++", DEBIAN_PYTHON, "bash"):
        if not shutil.which(tool):
            print(f"check_docs: {tool} is missing")
            return 77
    problems = []
    environment = os.path.join(docs, "environment.md")
    if not os.path.exists(environment):
        print("check_docs: docs/environment.md, the table of variables, does not exist")
        return 1
    env_problems, variables = check_environment(root, read(environment))
    problems += env_problems
    symbol_problems = check_symbols(root, pages)
    problems += symbol_problems
    link_problems, unwritten = check_links(root, files)
    problems += link_problems
    for path in files:
        problems += check_examples(root, os.path.relpath(path, root), read(path))
    print(f"links: {'all lead somewhere' if not link_problems else 'some lead nowhere'}"
          + (f"; pages the index lists that are not written yet: {', '.join(unwritten)}"
             if unwritten else ""))
    print(f"variables: {variables} read by kolo, "
          f"{'all' if not env_problems else 'not all'} in docs/environment.md once")
    print(f"functions: {len(exported_functions(root))} exported by kolo.h, "
          f"{'all' if not symbol_problems else 'not all'} named in docs/")

    runner = Runner(root, build)
    ran = 0
    started = time.monotonic()
    for path in files:
        shown = os.path.relpath(path, root)
        for snippet in snippets_of(shown, read(path)):
            began = time.monotonic()
            problem = runner.check(snippet)
            if problem == SKIPPED:
                continue
            ran += 1
            if problem:
                problems.append(f"{snippet.where()}: the `{snippet.lang}` block {problem}")
                print(f"FAIL  {snippet.where()} ({snippet.lang})")
            else:
                print(f"ok    {snippet.where()} ({snippet.lang}, {time.monotonic() - began:.1f} s)")
                if verbose:
                    print(tail(runner.last_output, 10))
    print(f"snippets: {ran} run in {len(files)} file(s), {time.monotonic() - started:.0f} s")
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
