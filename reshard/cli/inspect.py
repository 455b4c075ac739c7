"""`reshard inspect`: what a checkpoint holds, as text or JSON."""
from __future__ import annotations

import argparse
import sys

import reshard
from reshard.cli.output import dump
from reshard.commands.inspect import Inspection, human_bytes
from reshard.text import counted


def run(args: argparse.Namespace) -> int:
    catalog = reshard.open_checkpoint(args.path, args.tag, args.layout_rules, args.config)
    info = reshard.inspect(catalog, params=args.params)
    if args.json:
        dump(info.to_dict())
    else:
        print_inspect(info)
    if catalog.problems:    # what could be read is shown; the checkpoint is still not whole
        more = f" (and {len(catalog.problems) - 1} more; run `reshard validate`)" if len(catalog.problems) > 1 else ""
        print(f"reshard: {catalog.problems[0]}{more}", file=sys.stderr)
        return 1
    return 0


def print_inspect(info: Inspection) -> None:
    """inspect's human-readable summary of an Inspection."""
    t = info.topology
    print(f"{info.path}")
    framework = info.framework
    tag = f" (tag {info.tag})" if info.tag else ""     # only formats with tag folders have one
    print(f"  format        {framework['title'] if framework else info.format}{tag}")
    if info.framing:
        print(f"  read as       {info.framing}")
    for part in info.unread or ():
        print(f"  not read      {part['path']}: {part['what']}")
    if info.weights_only_line():
        print(f"  tier          {info.weights_only_line()}")
    zero = f", ZeRO stage {info.zero_stage}" if info.zero_stage else ""
    print(f"  topology      dp={t.dp} tp={t.tp} pp={t.pp} (world size {t.world_size}){zero}")
    if info.experts:
        e = info.experts
        print(f"  experts       ep={e['ep']} expert-dp={e['expert_dp']}; " + "; ".join(
            f"layer {layer['layer']}: {layer['experts']} experts, {'/'.join(map(str, layer['experts_per_rank']))} "
            "per rank" for layer in e["layers"]))
    known = {k: "unknown" if getattr(info, k) is None else getattr(info, k)
             for k in ("dtype", "master_dtype", "optimizer", "step", "global_steps", "global_samples")}
    print(f"  dtypes        model {known['dtype']}, master {known['master_dtype']}")
    print(f"  optimizer     {known['optimizer']}: states {', '.join(info.optimizer_states) or 'none'}")
    if info.options:
        print(f"  options       {', '.join(f'{k}={v}' for k, v in info.options.items())}")
    print(f"  step          {known['step']} (global_steps {known['global_steps']}, "
          f"global_samples {known['global_samples']})")
    if info.trainable is None or info.frozen is None:
        trained = "trainable and frozen not recorded (weights only)"
    else:
        trained = f"{info.trainable} trainable, {info.frozen} frozen" + \
            ((" before thinning" if info.thinned_from_full else "") + " (weights only)"
             if info.thinned is not None and not info.param_groups else "")
    print(f"  parameters    {info.parameters} ({info.elements:,} element{'s' * (info.elements != 1)}): "
          f"{trained}; {counted(info.buffers, 'buffer')}")
    for alias, source in info.aliases.items():
        print(f"  tied          {alias} -> {source}")
    for g, group in enumerate(info.param_groups):
        hyper = ", ".join(f"{k}={hyper_parameter(v)}" for k, v in group.items() if k != "params")
        print(f"  group {g:<7} {counted(group['params'], 'param')}; {hyper}")
        split = [s for s in info.split_scalars if s.group == g]
        for key in dict.fromkeys(s.key for s in split):
            print(f"  {'':<13} {key} differs per parameter: " +
                  ", ".join(f"{s.value} at {s.param}" for s in split if s.key == key))
    for state, n in info.bytes_per_state.items():
        print(f"  {state:<13} {human_bytes(n)}")
    print(f"  files         {len(info.files)}, {human_bytes(sum(f.bytes for f in info.files))}")
    for f in info.files:
        print(f"    {f.path:<48} {human_bytes(f.bytes):>10}")
    if framework and framework["files"]:
        print(f"  {framework['name']} {counted(len(framework['files']), 'file')} beside the "
              f"{framework['backend']} save, {human_bytes(sum(f['bytes'] for f in framework['files']))}")
        for f in framework["files"]:
            rank = "" if f["rank"] is None else f" (process {f['rank']})"
            print(f"    {f['path']:<32} {human_bytes(f['bytes']):>10}  {f['what']}{rank}")
    if info.entries:
        print(f"  {framework['name'] if framework else 'framework'} state  {len(info.entries)} "
              f"entr{'y' if len(info.entries) == 1 else 'ies'} in the checkpoint, carried by a conversion")
        for e in info.entries:
            print(f"    {e['key']:<32} {e['value']!s:>10}  {e['what']}")
    if info.problems:
        print(f"  problems      {info.problems} (run `reshard validate`)")
    for row in info.parameter_table or []:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        in_group = "" if row["group"] is None else f"group {row['group']}"
        tied = f"tied: {', '.join(row['tied_to_it'])}" if row["tied_to_it"] else ""
        where = f"tp {row['tensor_parallel']}" if "tensor_parallel" in row else ""
        if len(row.get("stages", [])) > 1:
            where = f"stages {','.join(map(str, row['stages']))}"
        print(f"    {row['name']:<32} {shape:<12} {row['kind']:<9} {row['dtype'] or '':<9} {in_group:<8} "
              f"{','.join(row['states'])} {tied} {where}".rstrip())
    for folder, each in info.companions:
        print(f"  model         {folder}/, another model of this checkpoint:")
        print_inspect(each)


def hyper_parameter(value: object) -> str:
    """A saved hyper-parameter for people: a float to the 12 significant digits it was configured with (an lr a
    scheduler computed, 0.0028000000000000004, is 0.0028: the float's last bits are arithmetic, not intent; --json
    keeps every bit)."""
    return f"{value:.12g}" if isinstance(value, float) else str(value)
