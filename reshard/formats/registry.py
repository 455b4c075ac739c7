"""The format registry: the one place a format is described. Everything else that names formats derives from it:
the order readers are tried in (reshard.formats.reader_for), the writers of `convert --format`, the lifecycle's
recognition of a run directory's checkpoints (reshard.lifecycle.units, run_layout), the weights-only forms `reshard
thin` writes, the command line's help and every "supported:" message; tests/test_registry.py holds the docs'
format table to it. Adding a format is a leaf: a folder under reshard/formats/ and one Format below.

Modules are named, not imported: a command imports the reader or writer it uses when it uses it (start-up time).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.formats.deepspeed import files as ds_files, topology as ds_topology, universal as ds_universal
from reshard.formats.megatron import topology as megatron_topology
from reshard.formats.protocol import MESH_ONLY, TargetKeys

TAG, RESOLVE = "tag", "resolve"     # how a pointer file names its checkpoint (Pointer.how)


@dataclass(frozen=True)
class WriterEntry:
    module: str             # satisfies protocol.Writer; imported when its format is written
    keys: TargetKeys        # what its output takes of a target topology (read by --help without importing it)


@dataclass(frozen=True)
class Pointer:
    """A file a framework writes beside its checkpoints once a save is done, naming the one it resumes from: the
    lifecycle (list, prune, watch) never deletes what it names, and holds back what is newer as still written."""
    file: str               # its name in the save dir
    reader: str             # the reader module whose format writes it
    how: str                # TAG: its text is the checkpoint's folder name; RESOLVE: the reader's resolve()


@dataclass(frozen=True)
class RunLayout:
    """How a training run's output directory holds this format's checkpoints, as list, prune and watch find them
    (reshard.lifecycle.units): names in a directory listing, no file opened. A pattern's group 1 is the step."""
    unit: str                   # how `list` names one of its checkpoints a reader sniffs ("deepspeed", "DCP")
    backend: str = ""           # what `list` adds to `unit` ("(DCP)")
    checkpoints: str = ""       # the folder its save loop gives each checkpoint: a folder of them is an output dir
    staging: str = ""           # the folder of a checkpoint being saved, renamed to `checkpoints` when done
    tags: str = ""              # its checkpoints' folders inside a save dir, which `pointer` marks
    pointer: str = ""           # the file naming the checkpoint a resume loads (Pointer)
    pointer_how: str = TAG
    suffix: str = ""            # a checkpoint file or folder is named so (Lightning's ".ckpt")

    def names(self) -> tuple[str, ...]:
        """The patterns of the folders of a run directory that are whole checkpoints of this format."""
        return tuple(p for p in (self.checkpoints, self.staging) if p)


@dataclass(frozen=True)
class ThinForm:
    """A weights-only form (reshard.formats.weights_only.Form), what the framework writes with its model-only option
    and loads with its weights-only load; `reshard thin` writes it."""
    module: str     # its form(catalog, path, keep_masters)
    what: str       # the checkpoints it thins, in words (the refusal of those it does not lists them)
    by: str         # the catalog format or the training framework (framework.Framework.name) whose checkpoints


@dataclass(frozen=True)
class Format:
    """One format: what reshard reads and writes of it, and how its checkpoints sit in a run directory."""
    name: str                       # as catalogs, `inspect`, `list` and `convert --format` spell it
    title: str                      # how the docs' format table (docs/formats/index.md) names it
    page: str                       # its page under docs/formats/
    reads: str                      # what is read, in words: --help and the refusal of a checkpoint none reads
    run: RunLayout
    readers: tuple[str, ...] = ()   # modules satisfying protocol.Reader: tried in the registry's order
    read_as: str = ""               # no reader of its own: the format whose reader reads it (catalog.format)
    # formats whose readers would take its checkpoints too (a Megatron-LM iteration folder is a DCP folder): its
    # readers are tried before theirs
    tried_before: tuple[str, ...] = ()
    writer: WriterEntry | None = None
    writes: str = ""                # what `convert --format NAME` writes, in words (--help)
    thin: tuple[ThinForm, ...] = ()
    # a model as its consumers publish it (what `export` writes): an export-names rule file given to `convert` from
    # it is read backwards, the model brought back under the names of the checkpoint the rule file exports from
    published: bool = False
    # (output format, why): the other formats its checkpoints are not converted to, each with the reason in words: a
    # writer of that format would write a folder its consumer does not load (convert refuses it, nothing written)
    not_written_as: tuple[tuple[str, str], ...] = ()


_TRAINER_WEIGHTS = ("reshard.formats.hf.trainer_weights",
                    "HF Trainer checkpoint-N/ with DeepSpeed ZeRO-1/2, DDP or FSDP (sharded or full state dict)")

FORMATS = (
    Format("deepspeed", "DeepSpeed ZeRO", "deepspeed.md", "DeepSpeed ZeRO save dirs and tag folders",
           RunLayout("deepspeed", tags=r"^global_step(\d+)$", pointer=ds_files.LATEST),
           readers=("reshard.formats.deepspeed.reader",),
           writer=WriterEntry("reshard.formats.deepspeed.writer", ds_topology.TARGET_KEYS),
           writes="DeepSpeed's save dir at any dp, ZeRO stage, tp, pp and ep; the default for a DeepSpeed source",
           thin=(ThinForm("reshard.formats.deepspeed.weights_only", "DeepSpeed ZeRO-1/2/3 tag folders", "deepspeed"),)),
    Format("universal", "DeepSpeed universal", "universal.md", "DeepSpeed universal checkpoints",
           RunLayout("universal", pointer=ds_universal.LATEST_UNIVERSAL),
           # a universal save dir may keep DeepSpeed's `latest` beside `latest_universal`
           readers=("reshard.formats.deepspeed.universal_reader",), tried_before=("deepspeed",),
           writer=WriterEntry("reshard.formats.deepspeed.universal_writer", ds_topology.TARGET_KEYS),
           writes="DeepSpeed's universal checkpoint"),
    # one file per data-parallel rank (tp=1 and pp=1 gather a model-parallel source), no ZeRO stage
    Format("dcp", "PyTorch DCP", "dcp.md", "PyTorch DCP directories",
           RunLayout("DCP"),
           readers=("reshard.formats.dcp.reader",),
           writer=WriterEntry("reshard.formats.dcp.writer", MESH_ONLY),
           writes="a PyTorch distributed checkpoint (dcp.load, FSDP2)",
           thin=(ThinForm("reshard.formats.dcp.weights_only", "plain DCP folders", "dcp"),)),
    Format("megatron", "Megatron-core", "megatron.md",
           "Megatron-LM save dirs (megatron-core torch_dist, the legacy torch format)",
           RunLayout("megatron", checkpoints=r"^iter_(\d+)$", pointer="latest_checkpointed_iteration.txt",
                     pointer_how=RESOLVE),
           # an iteration folder holds DCP's files (torch_dist); Megatron-DeepSpeed save dirs DeepSpeed's too
           readers=("reshard.formats.megatron.reader",), tried_before=("universal", "deepspeed", "dcp"),
           writer=WriterEntry("reshard.formats.megatron.writer", megatron_topology.TARGET_KEYS),
           writes="a Megatron-LM save dir (torch_dist) at any tp, pp and dp, its optimizer in the sharding "
                  "sharding= names",
           thin=(ThinForm("reshard.formats.megatron.weights_only", "Megatron-LM iteration folders", "megatron"),)),
    Format("fsdp", "FSDP", "frameworks.md",
           "FSDP's sharded state dict as HF Trainer, Accelerate and Lightning save it",
           RunLayout("fsdp"),
           # Lightning's FSDPStrategy *.ckpt/ is a DCP folder (+ meta.pt)
           readers=("reshard.formats.dcp.lightning_reader", "reshard.formats.dcp.fsdp_reader"), tried_before=("dcp",),
           # the framework's own files carried beside it as for DeepSpeed
           writer=WriterEntry("reshard.formats.dcp.fsdp_writer", MESH_ONLY),
           writes="the folders HF Trainer and Accelerate save with FSDP's sharded state dict: "
                  "pytorch_model_fsdp_0/, optimizer_0/",
           thin=(ThinForm("reshard.formats.dcp.lightning_weights",
                          "Lightning FSDPStrategy (sharded) and ModelParallelStrategy *.ckpt/", "Lightning"),)),
    # a DCP folder: read by the DCP reader, which finds torchtitan's own entries (dcp.torchtitan)
    Format("torchtitan", "torchtitan", "torchtitan.md", "torchtitan step-N/ folders",
           RunLayout("torchtitan", backend="(DCP)", checkpoints=r"^step-(\d+)$"),
           read_as="dcp",
           writer=WriterEntry("reshard.formats.dcp.torchtitan_writer", MESH_ONLY),
           writes="torchtitan's step-N folder (its CheckpointManager's flat keys), its own entries carried",
           thin=(ThinForm("reshard.formats.dcp.torchtitan_weights", "torchtitan step-N/", "torchtitan"),)),
    Format("verl", "verl", "verl.md",
           "verl global_step_N/ folders (actor, critic): FSDP, and the Megatron backend's model/dist_ckpt",
           RunLayout("verl", checkpoints=r"^global_step_(\d+)$", pointer="latest_checkpointed_iteration.txt",
                     pointer_how=RESOLVE),
           # a run folder holds Megatron-LM's tracker file name; a Megatron-backend role folder torch_dist saves
           readers=("reshard.formats.verl.reader", "reshard.formats.verl.megatron_reader"), tried_before=("megatron",),
           writer=WriterEntry("reshard.formats.verl.writer", MESH_ONLY),
           writes="verl's FSDP step folder at any world size (FSDP1 or FSDP2: weights, optimizer, lr scheduler), "
                  "the default for a verl source",
           not_written_as=(
               ("fsdp", "verl's FSDP optimizer is one param group over every parameter (build_optimizer), the HF "
                        "Trainer's AdamW two (weight decay by parameter name), and the Trainer's resume refuses "
                        "another grouping: a split would guess by names and change the decay of those it takes off; "
                        "verl's lr scheduler and step have no Trainer file either (--format dcp keeps the whole "
                        "state; export gives from_pretrained the weights)"),
               ("torchtitan", "torchtitan loads its own models' FQNs (tok_embeddings.weight, "
                              "layers.N.attention.qkv_linear.wq.weight), not the Hugging Face names verl saves "
                              "(model.embed_tokens.weight), and no rule file maps them with the optimizer (--format "
                              "dcp writes the same state under verl's names)"))),
    Format("hf-trainer", "HF Trainer", "single-process.md",
           "Hugging Face Trainer checkpoint folders (DeepSpeed, FSDP, one process)",
           RunLayout("hf-trainer", checkpoints=r"^checkpoint-(\d+)$", staging=r"^tmp-checkpoint-(\d+)$"),
           readers=("reshard.formats.hf.trainer",),
           # by its one-process catalogs' format and by the framework around an engine's save
           thin=(ThinForm(*_TRAINER_WEIGHTS, "hf-trainer"), ThinForm(*_TRAINER_WEIGHTS, "HF Trainer"))),
    # no reader of its own: its folder is read as the engine's save inside it, its files around it (framework)
    Format("accelerate", "Accelerate", "frameworks.md", "Accelerate save_state folders (DeepSpeed, FSDP)",
           RunLayout("accelerate", checkpoints=r"^checkpoint_(\d+)$"),
           thin=(ThinForm("reshard.formats.single.accelerate_weights",
                          "Accelerate save_state folders with DeepSpeed ZeRO-1/2/3, FSDP (sharded or full) or "
                          "neither",
                          "Accelerate"),)),
    Format("safetensors", "safetensors", "single-process.md", "safetensors files and save_pretrained folders",
           RunLayout("safetensors"),
           readers=("reshard.formats.hf.safetensors_reader",), published=True),
    Format("lightning", "Lightning", "single-process.md", "Lightning .ckpt files and folders",
           RunLayout("lightning", suffix=".ckpt"),
           readers=("reshard.formats.single.lightning",)),
    Format("torch", "torch.save", "single-process.md", "torch.save .pt/.pth/.bin files",
           RunLayout("torch"),
           readers=("reshard.formats.single.torchsave_checkpoint",)),
)


def entry(name: str) -> Format:
    """The registered format `name` (a KeyError for none: callers name the registry's own)."""
    for f in FORMATS:
        if f.name == name:
            return f
    raise KeyError(f"no format {name!r} in the registry")


def not_written_as(source: str, target: str) -> str | None:
    """Why checkpoints of format `source` are not converted to `target` (None: nothing said against it)."""
    return dict(entry(source).not_written_as).get(target) if any(f.name == source for f in FORMATS) else None


def readers() -> tuple[str, ...]:
    """Every reader module, in the order they are tried: the first whose sniff() accepts a path reads it. The
    registry's order, but a format's readers before those of every format it is tried before (and so before those
    that one is tried before: verl's before Megatron-LM's, before DCP's)."""
    waiting, ordered = list(FORMATS), []

    def take(f: Format) -> None:
        waiting.remove(f)
        for first in [g for g in waiting if f.name in g.tried_before]:
            if first in waiting:
                take(first)
        ordered.append(f)
    while waiting:
        take(waiting[0])
    return tuple(module for f in ordered for module in f.readers)


def writers() -> dict[str, WriterEntry]:
    """{format name: its writer}: the formats `convert --format` writes, in the registry's order."""
    return {f.name: f.writer for f in FORMATS if f.writer is not None}


def thin_forms() -> dict[str, ThinForm]:
    """{catalog format or framework name: the weights-only form of its checkpoints}."""
    return {form.by: form for f in FORMATS for form in f.thin}


def pointers() -> tuple[Pointer, ...]:
    """The pointer files of every format that writes one, each with the reader that resolves what it names."""
    return tuple(Pointer(f.run.pointer, f.readers[0], f.run.pointer_how) for f in FORMATS if f.run.pointer)


def run_patterns(kind: str) -> tuple[re.Pattern[str], ...]:
    """The run-directory names (RunLayout's `checkpoints`, `staging` or `tags`) of every format that has some."""
    return tuple(re.compile(getattr(f.run, kind)) for f in FORMATS if getattr(f.run, kind))


def supported() -> str:
    """What reshard reads, in words, for a refusal or --help."""
    return "; ".join(f.reads for f in FORMATS)


def thinnable() -> str:
    """The checkpoints that have a weights-only form, in words."""
    return ", ".join(dict.fromkeys(form.what for form in thin_forms().values()))
