"""scripts/seed_venv.py, which starts a new vLLM environment with what the built ones hold (CI ran
out of disk building 0.33 and 0.34 beside 0.22 and 0.26). The environments are real (`python -m
venv`); the packages in them are stand-ins written here (`standin_*`), with pip's own dist-info
layout, and the plan has the shape of pip's `--dry-run --report`."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def site(venv):
    return next(venv.glob("lib/python3*/site-packages"))


def standin(venv, name, version, requires=(), script=False, editable=False):
    """A stand-in distribution: one module, dist-info with RECORD, maybe a console script."""
    sp = site(venv)
    (sp / name).mkdir()
    (sp / name / "__init__.py").write_text(f"VERSION = {version!r}\n")
    info = sp / f"{name}-{version}.dist-info"
    info.mkdir()
    meta = ["Metadata-Version: 2.1", f"Name: {name.replace('_', '-')}", f"Version: {version}"]
    meta += [f"Requires-Dist: {dep}" for dep in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n\nA stand-in.\n")
    record = [f"{name}/__init__.py,,", f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    if script:
        bin_script = venv / "bin" / name
        bin_script.write_text(f"#!{venv.resolve()}/bin/python\nimport {name}\n")
        bin_script.chmod(0o755)
        record.append(f"../../../bin/{name},,")
    if editable:
        (info / "direct_url.json").write_text(
            '{"url": "file:///src", "dir_info": {"editable": true}}'
        )
    (info / "RECORD").write_text("\n".join(record) + "\n")


def plan_item(name, version, requires=()):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


def test_a_new_environment_links_what_a_built_one_holds_and_lists_the_rest(tmp_path):
    built, new = tmp_path / "built", tmp_path / "new"
    for venv in (built, new):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    standin(built, "standin_libs", "1.0", script=True)
    standin(built, "standin_old", "1.0")  # the plan wants 2.0: not linked
    standin(built, "standin_local", "1.0", editable=True)  # not the index's files
    standin(built, "standin_kept", "1.0")
    standin(new, "standin_kept", "0.9")  # installed in the new one: pip decides, not the seed
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "install": [
                    plan_item("standin-top", "1.0", ["standin_old>=2", "standin-libs==1.0"]),
                    plan_item("standin-old", "2.0", ["standin-libs; extra == 'x'"]),
                    plan_item("standin_libs", "1.0"),
                    plan_item("standin-local", "1.0"),
                    plan_item("standin-kept", "1.0"),
                ]
            }
        )
    )
    out = subprocess.run(
        [sys.executable, ROOT / "scripts" / "seed_venv.py", plan, new, built],
        capture_output=True,
        text=True,
        check=True,
    )
    # the rest, each after what it requires, for pip to install one at a time (standin-kept, at
    # another version in the new environment, is left to pip's install of the requirements)
    assert out.stdout.split() == [
        "standin-local==1.0",
        "standin-old==2.0",
        "standin-top==1.0",
    ]
    assert "1 of 5 packages" in out.stderr
    linked = site(new) / "standin_libs" / "__init__.py"
    assert linked.stat().st_ino == (site(built) / "standin_libs" / "__init__.py").stat().st_ino
    assert (site(new) / "standin_libs-1.0.dist-info" / "RECORD").exists()
    script = new / "bin" / "standin_libs"
    assert script.read_text().splitlines()[0] == f"#!{new.resolve()}/bin/python"
    assert os.access(script, os.X_OK) and script.stat().st_nlink == 1
    assert not (site(new) / "standin_old").exists()
    assert not (site(new) / "standin_local").exists()
    assert (site(new) / "standin_kept" / "__init__.py").read_text() == "VERSION = '0.9'\n"
