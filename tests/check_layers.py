#!/usr/bin/env python3
"""The layer check: fails when a file of kolo includes a layer it may not depend on.

kolo's code is in layers, one folder each (docs/architecture.md draws them). A
layer may include its own files and those of the layers LAYERS lists for it, never one above it:
this table is the one place where the allowed directions are written down. The check reads every
`#include "..."` line under src/, capi/ and bench/ (tests may include anything); it also checks
that the library includes the third-party headers of one layer's business (UCX, CUDA, NCCL)
nowhere else, and that the sub-folders of a layer (transport/tcp/, transport/ucx/, ...) do not
include one another, but for those SHARED_SUBFOLDERS names as building blocks.

docs/architecture.md has the same table, for readers; the check fails when the two
differ, so the picture cannot drift from what is enforced.

Usage: check_layers.py [SOURCE_ROOT]; prints every violation and exits 1 if there is one.
"""
import os
import re
import sys

# Each layer and the layers it may include, lowest first. "public" is include/kolo/ (status and
# dtype, implemented in core) and the generated kolo_build_config.h: every layer may use them.
LAYERS = {
    "core": [],
    "net": ["core"],
    "bootstrap": ["net", "core"],
    "transport": ["bootstrap", "net", "core"],
    "ring": ["transport", "core"],
    "gpu": ["transport", "bootstrap", "net", "core"],
    "fusion": ["ring", "gpu", "transport", "core"],
    "comm": ["fusion", "gpu", "ring", "transport", "bootstrap", "net", "core"],
    "capi": ["comm", "fusion", "core"],
    "tools": ["comm", "bootstrap", "net", "core"],
    "bench": ["capi"],
}

# Where each layer's files live, relative to the source root.
FOLDERS = {name: os.path.join("src", name) for name in LAYERS}
FOLDERS["capi"] = "capi"
FOLDERS["bench"] = "bench"

# Third-party headers that belong to one layer (or one sub-folder) of the library alone; the
# benchmarks may use them to set up their own buffers.
SYSTEM_HEADERS = [
    (re.compile(r"^(ucp|ucs|uct)/"), "src/transport/ucx"),
    (re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api|cuda_fp16|cuda_bf16)\.h$"), "src/gpu"),
    (re.compile(r"^nccl(_net)?\.h$"), "src/gpu"),
]

# Sub-folders that are building blocks of their layer, which its other sub-folders may include:
# kolo's shared-memory rings, which the UCX and TCP transports run beside their networks.
SHARED_SUBFOLDERS = {"transport": ["shm"]}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SOURCE_SUFFIXES = (".cpp", ".hpp", ".c", ".h", ".cu", ".cuh")


def layer_of_file(relative_path):
    """The layer a file of the tree belongs to, and its sub-folder inside it (or None)."""
    for name, folder in FOLDERS.items():
        if relative_path.startswith(folder + os.sep):
            rest = relative_path[len(folder) + 1:].split(os.sep)
            return name, rest[0] if len(rest) > 1 else None
    return None, None


def layer_of_include(target, including_dir, root):
    """The layer and sub-folder an include "target" refers to; ("public", None) for the public
    headers; (None, None) for a name no layer holds."""
    if target.startswith("kolo/") or target == "kolo_build_config.h":
        return "public", None
    if target == "kolo.h":
        return "capi", None
    # Beside the including file (perf_common.hpp in bench/) or under src/ ("ring/ring.hpp").
    for base in (including_dir, os.path.join(root, "src")):
        candidate = os.path.normpath(os.path.join(base, target))
        if os.path.exists(candidate):
            return layer_of_file(os.path.relpath(candidate, root))
    return None, None


def check(root):
    problems = []
    for top in ("src", "capi", "bench"):
        for directory, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, root)
                layer, sub = layer_of_file(relative)
                if layer is None:
                    problems.append(f"{relative}: in no layer (add its folder to LAYERS)")
                    continue
                with open(path, encoding="utf-8") as source:
                    for number, line in enumerate(source, 1):
                        match = INCLUDE.match(line)
                        if not match:
                            continue
                        bracket, target = match.groups()
                        where = f"{relative}:{number}"
                        if bracket == "<":
                            if layer == "bench":
                                continue
                            for pattern, home in SYSTEM_HEADERS:
                                if pattern.search(target) and not relative.startswith(home + os.sep):
                                    problems.append(f"{where}: <{target}> belongs in {home}/ only")
                            continue
                        to_layer, to_sub = layer_of_include(target, directory, root)
                        if to_layer is None:
                            problems.append(f'{where}: "{target}" is in no layer')
                        elif to_layer == "public":
                            continue
                        elif to_layer == layer:
                            if (sub and to_sub and sub != to_sub and
                                    to_sub not in SHARED_SUBFOLDERS.get(layer, [])):
                                problems.append(f'{where}: {layer}/{sub} includes "{target}" of '
                                                f"its sibling {layer}/{to_sub}")
                        elif to_layer not in LAYERS[layer]:
                            problems.append(f'{where}: {layer} includes "{target}" of {to_layer}, '
                                            f"which it may not (allowed: "
                                            f"{', '.join(LAYERS[layer]) or 'nothing'})")
    return problems


README_ROW = re.compile(r"^\| (\w+) \| `([^`]+)/` \| ([^|]*) \|$")


def check_readme(root):
    """docs/architecture.md's table of layers, against LAYERS and FOLDERS."""
    table = {}
    with open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8") as readme:
        for line in readme:
            match = README_ROW.match(line.strip())
            if match:
                name, folder, allowed = match.groups()
                allowed = [] if allowed.strip() == "nothing" else \
                    [part.strip() for part in allowed.split(",")]
                table[name] = (folder, allowed)
    expected = {name: (FOLDERS[name], allowed) for name, allowed in LAYERS.items()}
    if table == expected:
        return []
    problems = []
    for name in sorted(set(table) | set(expected)):
        if table.get(name) != expected.get(name):
            problems.append(f"docs/architecture.md: the layer table says {name}: {table.get(name)}, "
                            f"check_layers.py says {expected.get(name)}")
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    problems = check(root) + check_readme(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} include(s) against the layers (tests/check_layers.py LAYERS)")
        return 1
    print(f"layers hold: {', '.join(LAYERS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
