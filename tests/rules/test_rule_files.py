"""The shipped rule files lie in folders by kind (reshard/layouts/<kind>/), every one found by its name under the
flag that reads its kind and read by the one loader (rules.files.load: kind and version checked). Negative controls:
a file moved into another kind's folder is refused by that loader with one line naming it, and is no longer found
under its own kind's flag. A file left at the top of the tree (where the flat layout kept them) fails the first test.
"""
import json
import shutil

import pytest

from reshard.errors import ReshardError, UsageError
from reshard.rules import files as rule_files
from tests.helpers.cli import run_cli
from tests.helpers.repo import REPO

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


@pytest.mark.parametrize("kind", [rule_files.MODULE_NAMES, rule_files.EXPORT_NAMES])
def test_both_names_languages_are_read_by_one_parser(kind, tmp_path):
    """module_names and export_names load through name_rules: the same one-line refusal of a file whose "rules" is
    not a list, and of a rule whose match is no regular expression, naming the file (and the rule)."""
    from reshard.rules import export_names, module_names
    load = {rule_files.MODULE_NAMES: module_names.load, rule_files.EXPORT_NAMES: export_names.load}[kind]
    path = tmp_path / "names.json"
    path.write_text(json.dumps({"kind": kind, "version": 1, "rules": {}}))
    with pytest.raises(ReshardError, match='"rules" must be a list') as caught:
        load(str(path))
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    path.write_text(json.dumps({"kind": kind, "version": 1, "rules": [{"match": "a(", "name": "b"}]}))
    with pytest.raises(ReshardError, match="rule 0: bad regular expression"):
        load(str(path))
    path.write_text(json.dumps({"kind": kind, "version": 1, "rules": [{"match": r"a\.(\d+)", "name": r"b.\1"}]}))
    loaded = load(str(path))
    assert loaded.rules[0].pattern.fullmatch("a.7") and loaded.rules[0].name == r"b.\1"


def test_a_rename_undone_gives_the_name_back_and_a_pattern_that_cannot_be_is_refused():
    """name_rules.undone (import_names reads export-names files through it): the template becomes a pattern whose
    match, through the undone template, is the original name. Negative control: a match with a bare "." outside its
    groups is no literal text, and is refused in one line."""
    import re

    from reshard.rules import name_rules
    match, template = re.compile(r"model\.layers\.(\d+)\.mlp\.(\w+)\.weight"), r"decoder.\1.\2.w"
    back, back_template = name_rules.undone("rules.json", 3, match, template)
    renamed = match.sub(template, "model.layers.12.mlp.up.weight")
    assert renamed == "decoder.12.up.w"
    assert back.fullmatch(renamed).expand(back_template) == "model.layers.12.mlp.up.weight"
    with pytest.raises(ReshardError, match=r"rules\.json.*rule 3: .*cannot be undone"):
        name_rules.undone("rules.json", 3, re.compile(r"model.layers\.(\d+)"), r"x.\1")
