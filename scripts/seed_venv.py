"""Start a new vLLM environment with the packages it shares with those already built, as hard links.

    python scripts/seed_venv.py PLAN.json NEW_VENV BUILT_VENV... > REST.txt

PLAN.json is pip's `--dry-run --report` for the new environment: every package it names at a
version a built environment already holds is linked in (files and dist-info), so pip finds it
installed and unpacks only the rest. The disk then never holds a second copy of the CUDA
libraries two vLLM versions share, not even until scripts/setup-vllm.sh's hardlink pass: CI ran
out of disk building 0.33 and 0.34 beside 0.22 and 0.26. Console scripts are written, not linked,
with the new environment's interpreter on their first line. The packages left to install are
printed one `name==version` a line, for scripts/setup-vllm.sh to install one at a time: pip
keeps every wheel of one command on disk until it ends (about 2 GB more at the peak for 0.33).
"""

import json
import os
import re
import sys
from pathlib import Path


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def site_of(venv):
    found = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"seed_venv: no site-packages under {venv}")
    return found[0]


def installed(venv):
    """(name, version) -> dist-info folder for each package installed from an index in VENV."""
    dists = {}
    for info in site_of(venv).glob("*.dist-info"):
        if (info / "direct_url.json").exists():
            continue  # editable or local: its files are not the index's wheel
        head = (info / "METADATA").read_text(errors="replace").split("\n\n", 1)[0]
        name = re.search(r"^Name: *(.+)$", head, re.M)
        version = re.search(r"^Version: *(.+)$", head, re.M)
        if name and version and (info / "RECORD").exists():
            dists[(canonical(name[1].strip()), version[1].strip())] = info
    return dists


def link_dist(info, old_venv, new_venv, new_site):
    """Link one distribution's files into NEW_SITE; returns (files, bytes)."""
    old_site, files, size = info.parent, 0, 0
    for line in (info / "RECORD").read_text().splitlines():
        rel = line.rsplit(",", 2)[0]
        src = os.path.normpath(old_site / rel)
        dst = os.path.normpath(new_site / rel)
        if not rel or not os.path.isfile(src) or os.path.lexists(dst):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if rel.startswith(".."):  # a console script: its first line names its interpreter
            text = Path(src).read_bytes()
            first, _, rest = text.partition(b"\n")
            first = first.replace(str(Path(old_venv).resolve()).encode(), str(new_venv).encode())
            Path(dst).write_bytes(first + b"\n" + rest)
            os.chmod(dst, os.stat(src).st_mode)
        else:
            os.link(src, dst)
        files += 1
        size += os.path.getsize(src)
    return files, size


def in_order(items):
    """The plan's packages, each after those it requires (markers ignored; a cycle in any order):
    a package whose .pth imports another must not be installed alone before it."""
    requires = {
        canonical(item["metadata"]["name"]): [
            canonical(re.match(r"[A-Za-z0-9._-]+", dep)[0])
            for dep in item["metadata"].get("requires_dist") or []
        ]
        for item in items
    }
    version = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in items}
    done = []

    def visit(name, path=()):
        if name in done or name not in version or name in path:
            return
        for dep in requires[name]:
            visit(dep, (*path, name))
        done.append(name)

    for name in sorted(version):
        visit(name)
    return [(name, version[name]) for name in done]


def main(plan, new_venv, *built):
    ordered = in_order(json.loads(Path(plan).read_text())["install"])
    wanted = set(ordered)
    new_venv = Path(new_venv).resolve()
    new_site = site_of(new_venv)
    have = {name for name, _ in installed(new_venv)}  # pip replaces these itself, if it must
    done, files, size = [], 0, 0
    for venv in built:
        for key, info in installed(venv).items():
            if key in wanted and key[0] not in have:
                n, b = link_dist(info, venv, new_venv, new_site)
                have.add(key[0])
                done.append(key[0])
                files, size = files + n, size + b
    for name, version in ordered:
        if name not in have:
            print(f"{name}=={version}")
    print(
        f"seed_venv: {new_venv.name}: {len(done)} of {len(wanted)} packages from "
        f"{', '.join(built) or 'no built environment'} as hard links "
        f"({files} files, {size / 1e9:.1f} GB not written again)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
