"""The README and its docs/ pages stand alone: their Python runs, their paths and links exist, the code's
layout (docs/code.md) matches the tree."""
import json
import re
from pathlib import Path

import pytest

from ..fresh import run_fresh

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# the docs pages in the order the README lists them: their Python blocks run after the README's, in that order
DOCS = list(dict.fromkeys(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README)))
PAGES = {"README.md": README, **{page: (ROOT / page).read_text() for page in DOCS}}


def blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_the_readme_is_read_in_ten_minutes_and_lists_every_page():
    assert len(README.splitlines()) <= 300
    assert sorted(DOCS) == sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


# run after the README's blocks, in the same process: what they left behind, as one JSON line
CHECKS = r"""
import json as _json, os as _os
import jax as _jax
_module = jm.to_module()                        # the JAX backend's parameters after one AdamW step, on the CPU
print("CHECKS" + _json.dumps({
    "jax_spec": str(jm.params["model.layers.0.self_attn.q_proj.weight"].sharding.spec),
    "jax_devices": len(_jax.devices()), "jax_logits": [list(logits.shape), type(logits).__name__],
    "jax_collectives": [jm.audit(tokens).count(c) for c in ("all-reduce", "all-gather")],
    "jax_grads": [len(grads), len(jm.params)], "fast_path": torch.backends.mha.get_fastpath_enabled(),
    "jax_loss": [float(loss), float(loss_fn(_module, tokens))],
    "async": handle.result(), "loaded": step, "steps": sorted(_os.listdir(ckpt)), "exported": sorted(_os.listdir(out)),
}))
"""


@pytest.mark.complete  # 90 s: every block of the README and the docs pages in one fresh process
def test_every_python_block_runs_in_order():
    """As a reader pastes them, one after the other, in a process with only the documented environment;
    then what the blocks built is checked in that process (``CHECKS``)."""
    code = [block for text in PAGES.values() for block in blocks("python", text)]
    out = run_fresh("\n".join([*code, CHECKS]), timeout=900)
    assert "column-parallel" in out and "communication bytes/device" in out
    checks = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("CHECKS")))
    # parallelize_jax: parameters sharded on the mesh of 8 CPU devices, torch tensors out, the fast path of
    # torch's attention kept, gradients for every parameter, one AdamW step lowers the loss on its batch
    assert checks["jax_spec"] == "PartitionSpec('model', None)" and checks["jax_devices"] == 8
    assert checks["jax_logits"] == [[4, 16, 128], "Tensor"] and checks["fast_path"] is True
    assert checks["jax_collectives"] == [5, 0]                        # embedding + 2 per layer, nothing gathered
    assert checks["jax_grads"][0] == checks["jax_grads"][1] == 21
    assert checks["jax_loss"][1] < checks["jax_loss"][0], checks["jax_loss"]
    # training at scale: an async save's handle gives its directory, the newest step loads, HF files out
    assert checks["async"].endswith("step_00000200") and checks["loaded"] == 200
    assert checks["steps"] == ["step_00000100", "step_00000200"]
    assert {"model.safetensors", "config.json"} <= set(checks["exported"])


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_anchors_resolve():
    for page, text in PAGES.items():
        anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
        for target in re.findall(r"\]\(([^)]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            if target.startswith("#"):
                assert target[1:] in anchors, f"{page} links to a missing heading {target}"
            else:
                assert (ROOT / page).parent.joinpath(target).exists(), f"{page} links to a missing path {target}"


def ignored_top_level() -> set[str]:
    """Top-level names ``.gitignore`` lists: what the jobs write into a checkout (``runs/``, ``.venv``)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip().rstrip("/") for line in lines if line.strip() and not any(c in line for c in "*#!")
            and "/" not in line.strip().rstrip("/")}


def repo_paths_in_code_spans() -> list[str]:
    """Code spans that name something in the repository: their first segment is a top-level entry
    (``recipes/``, ``xla_tp/launch/fit.py``, ``setup.py``), or they climb out of it (``../x``). What the
    jobs write into the checkout (``runs/RECIPE-TIME`` after the demo) is not the repository's."""
    top = {p.name for p in ROOT.iterdir()} - ignored_top_level()
    spans = [s for text in PAGES.values() for s in re.findall(r"`([^`\s]+)`", text)]
    return [s for s in spans if s.startswith("../") or (s.split("/")[0] in top and ("/" in s or "." in s))]


def test_every_path_the_readme_names_exists():
    paths = repo_paths_in_code_spans()
    assert {"xla_tp/dynamo.py", ".ci/run"} <= set(paths)  # the check does see paths
    missing = [p for p in paths if not (ROOT / p.rstrip("/")).resolve().is_relative_to(ROOT)
               or not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"the README or docs name paths that are not in the repository: {missing}"


def test_outputs_of_the_jobs_are_not_repository_paths():
    assert {"runs", ".venv", ".venv-core", "build", "dist"} <= ignored_top_level()
    assert any("runs/RECIPE-TIME" in text for text in PAGES.values()) and "runs/RECIPE-TIME" not in repo_paths_in_code_spans()


def test_ci_runs_the_readme_commands_in_the_readmes_order():
    """The quick start's commands, one after the other in one checkout (the demo writes runs/ first), then the
    complete tier the README names."""
    quick = README.split("## Quick start", 1)[1]
    commands = [line.split("#")[0].strip() for line in blocks("bash")[0].splitlines() if line.strip()]
    assert blocks("bash")[0] in quick and commands == ["bash scripts/dev.sh demo", "bash scripts/dev.sh test"]
    assert "`bash scripts/dev.sh complete`" in quick
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("bash ")]
    assert ci == [*commands, "bash scripts/dev.sh complete"]


def test_the_layout_block_matches_the_tree():
    layout = PAGES["docs/code.md"]
    tree = re.search(r"```\n(.*?)```", layout, re.S).group(1)
    parents: list[str] = []
    listed = []
    for line in tree.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        parents = parents[:depth]
        path = "/".join([*parents, name.rstrip("/")])
        listed.append(path)
        assert (ROOT / path).exists(), f"docs/code.md lists {path}, which is not in the tree"
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
    # every module of the package, of the launcher, and every top-level entry has a line (add yours)
    for entry in [*(ROOT / "xla_tp").iterdir(), *(ROOT / "xla_tp" / "launch").glob("*.py"), *ROOT.iterdir()]:
        path = str(entry.relative_to(ROOT))
        ignored = entry.name in ("__pycache__", ".git", ".gitignore", ".venv", ".venv-core", "runs", "README.md", "build",
                                 "dist", ".pytest_cache") or entry.name.endswith(".egg-info")
        if not ignored and entry.name != "__init__.py" or path == "xla_tp/__init__.py":
            assert path in listed, f"{path} is missing from the layout in docs/code.md"


def test_nothing_points_outside_the_repository():
    files = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".ipynb", ".sh")
             and ".venv" not in p.parts and "runs" not in p.parts]
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if re.search(r"\.\./shared|FACTS\.md|DESIGN\.md", p.read_text(errors="ignore"))
                 and p.name != "test_readme.py"]
    assert not offenders, f"references to files outside the repository in {offenders}"
