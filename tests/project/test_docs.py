"""Every shell block of README.md and docs/ runs on the fixtures (the convention: tests/helpers/doc_blocks.py); what is
not
run is named, with why, and counted; the site builds with `mkdocs build --strict`; README's links lead to pages."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import lifecycle_runs
from tests.helpers.doc_blocks import SETUP_REASON, Block, DocBlockError, blocks, commands, is_setup, run_block
from tests.helpers.fixtures import fixture_dir
from tests.helpers.hf_sources import make_llama, make_mixtral, torchtitan_hf_config
from tests.helpers.repo import REPO
from tests.helpers.trainer_folders import hf_folder

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCKS = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in BLOCKS if b.not_run is None]
# What the documentation shows but no test here runs: torchrun jobs, benchmarks, a sidecar that runs until killed,
# the test suite itself, and the set-up commands of the README (a venv, pip install). Change it with the docs.
NOT_RUN = 26


def not_run() -> list[tuple[str, str, str]]:
    """(FILE:LINE, what, why) of every block marked not run and every set-up command."""
    found = [(b.where, b.text.split("\n")[0], b.not_run) for b in BLOCKS if b.not_run is not None]
    return found + [(f"{b.path}:{c.line}", " ".join(c.argv), SETUP_REASON) for b in RUN for c in commands(b)
                    if is_setup(c.argv)]


# -- makers: what a block's `<!-- test: NAME = @maker -->` stands for, each made once and copied ------------------

def deepspeed_run(root):
    return lifecycle_runs.deepspeed_run(root)


def trainer_run(root):
    """A Hugging Face Trainer's output dir: checkpoint-2 ... checkpoint-8, each a real DeepSpeed save with the
    Trainer's files, its trainer_state.json's log_history an eval_loss at every save (a real Trainer run takes a
    minute: the lifecycle tests have theirs)."""
    out, history = root / "out", []
    for step in (2, 4, 6, 8):
        history.append({"step": step, "eval_loss": round(3 - step / 10, 2)})
        folder = hf_folder(out, name=f"checkpoint-{step}")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    lifecycle_runs.age(out)
    return out


def hf_trainer_deepspeed(root):
    return hf_folder(root, name="checkpoint")


def accelerate_deepspeed(root):
    """A DeepSpeed save with Accelerate's files beside it (their bytes are only carried)."""
    folder = root / "state"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), folder)
    for name in ("random_states_0.pkl", "random_states_1.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"):
        (folder / name).write_bytes(name.encode() * 3)
    return folder


def evals_csv(root):
    """A metrics file with an `acc` for each step of deepspeed_run."""
    path = root / "evals.csv"
    path.write_text("step,acc\n" + "".join(f"{step},{0.5 + step / 100}\n" for step in range(1, 9)))
    return path


def hf_llama(root):
    """A Hugging Face Llama folder made by transformers with random weights
    (tests/helpers/hf_sources.py's fp32, as tests/formats/megatron/test_megatron_import.py makes it)."""
    make_llama(root / "hf-llama", "fp32")
    return root / "hf-llama"


def hf_mixtral(root):
    """A Hugging Face Mixtral folder made by transformers with random weights
    (tests/helpers/hf_sources.py's, as tests/formats/megatron/test_megatron_import_moe.py makes it)."""
    make_mixtral(root / "hf-mixtral")
    return root / "hf-mixtral"


def torchtitan_config(root):
    """The Hugging Face config.json of the torchtitan fixtures' model (what a torchtitan run's hf_assets_path holds)."""
    return Path(torchtitan_hf_config(root))


MAKERS = {"deepspeed-run": deepspeed_run, "trainer-run": trainer_run, "hf-trainer-deepspeed": hf_trainer_deepspeed,
          "accelerate-deepspeed": accelerate_deepspeed, "evals-csv": evals_csv, "torchtitan-config": torchtitan_config,
          "hf-llama": hf_llama, "hf-mixtral": hf_mixtral}


@pytest.fixture(scope="session")
def makers(tmp_path_factory):
    """Each maker's output made once, on first use; each block gets a copy (mtimes kept)."""
    made = {}

    def copier(name):
        def copy(dest):
            if name not in made:
                made[name] = MAKERS[name](tmp_path_factory.mktemp(name))
            if made[name].is_dir():
                shutil.copytree(made[name], dest, symlinks=True)
            else:
                shutil.copy2(made[name], dest)
        return copy
    return {name: copier(name) for name in MAKERS}


# -- the documentation's blocks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_the_block_runs(block, tmp_path, makers):
    run_block(block, tmp_path, makers)


def test_what_is_not_run_is_named_and_counted():
    skipped = not_run()
    listing = "\n".join(f"{where}: {what}  ({why})" for where, what, why in skipped)
    assert all(why for _, _, why in skipped)
    assert len(skipped) == NOT_RUN, f"{len(skipped)} commands or blocks are not run, NOT_RUN says {NOT_RUN}:\n{listing}"


def test_the_site_builds_strictly(tmp_path):
    """mkdocs.yml is strict: a broken link or anchor, or a page left out of the nav, fails the build."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", tmp_path],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_readme_links_lead_to_files():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
    assert links and [link for link in links if "://" not in link and not (REPO / link).exists()] == []


# -- the runner, and its negative controls --------------------------------------------------------------------------

def page(tmp_path, text: str, name="page.md") -> list[Block]:
    (tmp_path / name).write_text(text)
    return blocks(tmp_path / name, root=tmp_path)


def test_a_broken_command_fails_naming_its_file_and_line(tmp_path, makers):
    """Negative control: the second command reads a checkpoint that is not there."""
    (block,) = page(tmp_path, "Some text.\n\n```sh\nreshard inspect fixtures/z2_fp32_dp2/checkpoint\n"
                              "reshard inspect fixtures/no_such_fixture/checkpoint\n```\n")
    (tmp_path / "run").mkdir()
    with pytest.raises(DocBlockError, match=r"^page\.md:5: `reshard inspect fixtures/no_such_fixture/checkpoint` "
                                            r"exited 1"):
        run_block(block, tmp_path / "run", makers)


def test_a_doc_block_broken_in_a_copy_of_its_page_fails(tmp_path, makers):
    """Negative control on a real page: its DCP block, with a format reshard does not write, fails; as written, the
    same block runs (test_the_block_runs)."""
    text = (REPO / "docs" / "formats" / "dcp.md").read_text()
    assert text.count("--format dcp --to dp=2 ") == 1
    (block,) = page(tmp_path, text.replace("--format dcp --to dp=2 ", "--format dcpx --to dp=2 "), name="dcp.md")
    (tmp_path / "run").mkdir()
    with pytest.raises(DocBlockError, match=r"^dcp\.md:\d+: `reshard convert .* --format dcpx .*` exited 2"):
        run_block(block, tmp_path / "run", makers)


def test_failing_commands_fail_and_tmp_is_the_blocks_folder(tmp_path, makers):
    """Negative controls: `python -c` (in process) exiting 3 or raising, a process (mkdir) failing."""
    (ok, exits, raises, process) = page(
        tmp_path, "```bash\ncd /tmp && python -c 'open(\"made\", \"w\").close()' && mkdir /tmp/sub\n```\n\n"
                  "```sh\npython -c 'import sys; sys.exit(3)'\n```\n\n```sh\npython -c 'raise ValueError(42)'\n```\n\n"
                  "```sh\nmkdir /tmp/sub/deeper/still\n```\n")
    for name in "abcd":
        (tmp_path / name).mkdir()
    assert run_block(ok, tmp_path / "a", makers) == []
    assert (tmp_path / "a" / "made").exists() and (tmp_path / "a" / "sub").is_dir()
    with pytest.raises(DocBlockError, match=r"^page\.md:6: `python -c 'import sys; sys.exit\(3\)'` exited 3"):
        run_block(exits, tmp_path / "b", makers)
    with pytest.raises(DocBlockError,
                       match=r"(?s)^page\.md:10: `python -c 'raise ValueError\(42\)'` exited 1.*ValueError: 42"):
        run_block(raises, tmp_path / "c", makers)
    with pytest.raises(DocBlockError, match=r"^page\.md:14: `mkdir /tmp/sub/deeper/still` exited 1"):
        run_block(process, tmp_path / "d", makers)


def test_setup_commands_are_counted_not_run_and_the_rest_runs(tmp_path, makers):
    (block,) = page(tmp_path, "```sh\npython3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
                              "reshard convert fixtures/z2_fp32_dp2/checkpoint /tmp/out --to dp=3 --quiet\n```\n")
    (tmp_path / "run").mkdir()
    skipped = run_block(block, tmp_path / "run", makers)
    assert [(s.where, s.what, s.reason) for s in skipped] == [
        ("page.md:2", "python3 -m venv .venv", SETUP_REASON), ("page.md:2", ". .venv/bin/activate", SETUP_REASON),
        ("page.md:2", "pip install -e .", SETUP_REASON)]
    assert (tmp_path / "run" / "out" / "latest").exists()


def test_annotations_give_inputs_and_reasons(tmp_path, makers):
    given, skipped = page(tmp_path, "<!-- test: ckpt/ = fixtures/z2_fp32_dp2/checkpoint -->\n"
                                    "<!-- test: evals.csv = @evals-csv -->\n```sh\nreshard validate ckpt/\n```\n\n"
                                    "<!-- test: not run: starts 4 processes -->\n```sh\ntorchrun -m reshard x\n```\n")
    assert given.needs == (("ckpt/", "fixtures/z2_fp32_dp2/checkpoint"), ("evals.csv", "@evals-csv"))
    (tmp_path / "run").mkdir()
    assert run_block(given, tmp_path / "run", makers) == []
    assert (tmp_path / "run" / "evals.csv").read_text().startswith("step,acc\n")
    assert [(s.where, s.reason) for s in run_block(skipped, tmp_path / "run", makers)] == [
        ("page.md:8", "starts 4 processes")]


@pytest.mark.parametrize("text, error", [
    ("<!-- test: not run: -->\n```sh\nx\n```\n", r"page\.md:2: `not run:` without a reason"),
    ("<!-- test: skip it -->\n```sh\nx\n```\n", r"page\.md:2: an annotation the doc tests do not know"),
    ("```sh\nreshard list out/\n```\n", None),
    ("```sh\nreshard list out/ | head -1\n```\n", r"page\.md:2: `\|` is shell syntax"),
    ("```sh\nreshard list out/ > list.txt\n```\n", r"page\.md:2: `>` is shell syntax"),
    ("```sh\nreshard watch out/ &\n```\n", r"page\.md:2: `&` is shell syntax"),
    ("```sh\nreshard list $(pwd)\n```\n", r"page\.md:2: `\$\(` is shell syntax"),
    ("```sh\nreshard list 'out/\n```\n", r"page\.md:\d: an unclosed '"),
    ("```sh\nreshard list out/\n", r"page\.md:1: a code block that is never closed"),
])
def test_what_the_runner_refuses(tmp_path, text, error):
    """Negative controls: a construct the runner does not take is an error naming FILE:LINE, never run wrongly."""
    if error is None:
        (block,) = page(tmp_path, text)
        assert commands(block)[0].argv == ("reshard", "list", "out/")
        return
    with pytest.raises(DocBlockError, match=error):
        for block in page(tmp_path, text):
            commands(block)


def test_commands_keep_their_lines_across_continuations_and_quotes(tmp_path):
    (block,) = page(tmp_path, "```sh\nreshard plan ckpt/ \\\n  --to dp=4   # a comment\ncd /tmp && python -c \"\n"
                              "print('#1; && not split')\n\" ; reshard list 'a b'\n```\n")
    assert [(c.line, c.argv) for c in commands(block)] == [
        (2, ("reshard", "plan", "ckpt/", "--to", "dp=4")), (4, ("cd", "/tmp")),
        (4, ("python", "-c", "\nprint('#1; && not split')\n")), (6, ("reshard", "list", "a b"))]
