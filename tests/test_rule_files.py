"""The shipped rule files lie in folders by kind (reshard/layouts/<kind>/), every one found by its name under the
flag that reads its kind and read by the one loader (rules.files.load: kind and version checked). Negative controls:
a file moved into another kind's folder is refused by that loader with one line naming it, and is no longer found
under its own kind's flag. A file left at the top of the tree (where the flat layout kept them) fails the first test.
"""
import json
import shutil

import pytest

from conftest import REPO, run_cli
from reshard.errors import ReshardError, UsageError
from reshard.rules import files as rule_files

TREE = REPO / "reshard" / "layouts"


def test_every_shipped_file_lies_in_the_folder_of_its_kind():
    kind_of_folder = {folder: kind for kind, folder in rule_files.FOLDER.items()}
    loaded = 0
    for path in sorted(TREE.rglob("*.json")):
        folder = path.parent.relative_to(TREE).as_posix()
        assert folder in kind_of_folder, f"{path}: not in a folder of a kind ({', '.join(kind_of_folder)})"
        kind = kind_of_folder[folder]
        assert json.loads(path.read_text())["kind"] == kind, path
        found, spec = rule_files.load(path.stem, kind)
        assert found == str(path) and spec["version"] == 1
        loaded += 1
    assert loaded == sum(len(rule_files.shipped(kind)) for kind in rule_files.FOLDER) >= 14
    assert {p.name for p in TREE.iterdir() if p.is_file()} == {"README.md"}


@pytest.mark.parametrize("args", [("inspect", "--help"), ("export", "--help"), ("convert", "--help")])
def test_the_names_users_pass_are_listed(args):
    out = run_cli(*args, check=0).stdout
    wanted = {"inspect": ["megatron-gpt", "llama-autotp"], "export": ["megatron-core-llama", "mixtral-autoep-hf"],
              "convert": ["dp4-zero3", "mixtral-autoep-fsdp"]}[args[0]]
    flat = " ".join(out.split())
    assert all(name in flat for name in wanted), (wanted, out)


@pytest.fixture
def moved(tmp_path, monkeypatch):
    """A copy of the shipped tree with megatron-gpt.json (tp-rules) put in export-names/."""
    tree = tmp_path / "layouts"
    shutil.copytree(TREE, tree)
    (tree / "tp-rules" / "megatron-gpt.json").rename(tree / "export-names" / "megatron-gpt.json")
    monkeypatch.setattr(rule_files, "SHIPPED", tree)
    return tree


def test_a_file_in_another_kinds_folder_is_refused(moved):
    with pytest.raises(ReshardError) as caught:
        rule_files.load("megatron-gpt", rule_files.EXPORT_NAMES)
    message = str(caught.value)
    assert "\n" not in message and str(moved / "export-names" / "megatron-gpt.json") in message
    assert '"kind": "reshard.export-names"' in message
    with pytest.raises(UsageError, match="megatron-gpt"):
        rule_files.find("megatron-gpt", rule_files.TP_RULES)
    assert "megatron-gpt" not in rule_files.shipped(rule_files.TP_RULES)
    assert rule_files.load("llama-autotp", rule_files.TP_RULES)[1]["kind"] == rule_files.TP_RULES
