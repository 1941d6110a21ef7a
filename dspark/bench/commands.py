"""`dspark bench ...` subcommands. Results go to docs/results/<benchmark>/ by default (--quick: /tmp).

    dspark bench decode    plain decoding vs transformers generate()
    dspark bench offline   tau per dataset, acceptance per position, threshold sweep (Table 1, Figs. 2, 5)
    dspark bench online    closed-loop serving frontier and verification budget (Figs. 7, 8)
    dspark bench peers     single stream vs transformers generate() (greedy, prompt lookup)
    dspark bench soak      the server under mixed load and faults for --duration s: RSS, KV pool, errors
    dspark bench host      per-step host time near the start vs the end of a 4,000-token generation
    dspark bench steps     the anatomy of a drafted step against a plain one (proposal / plain, drafted / plain)
    dspark bench exact     greedy output of every drafter x policy against plain decoding, alone and batched
"""

from __future__ import annotations

import argparse


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _configs(text: str) -> list[str]:
    """';'-separated configurations, e.g. 'none;dspark:static:7'."""
    return [c.strip() for c in text.split(";") if c.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _out(args: argparse.Namespace, name: str) -> str:
    from dspark.report import DEFAULT_OUT

    return args.out or (f"/tmp/dspark-bench-quick/{name}" if args.quick else f"{DEFAULT_OUT}/{name}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="built-in name or HF-format directory (default dspark-small)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--out", default=None, help="output directory (default docs/results/<benchmark>, --quick: /tmp)")
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (never a speed claim)")


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)
    d = sub.add_parser("decode", help="plain decoding: this engine vs transformers generate()")
    d.add_argument("--model", default=None)
    d.add_argument("--concurrency", type=_ints, default=[1, 16])
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (never a speed claim)")
    d.add_argument("--out", default=None)
    d.set_defaults(func=run_decode)

    o = sub.add_parser("offline", help="tau per dataset, acceptance per position, threshold sweep (batch size 1)")
    _common(o)
    o.add_argument("--drafters", type=_names, default=None, help="names or directories (default: all five kinds)")
    o.add_argument("--datasets", type=_names, default=None, help="shipped sets (default: all five)")
    o.add_argument("--prompts", default=None, help="a JSONL file with `turns` or `prompt` (+ optional `domain`)")
    o.add_argument("--num-prompts", type=int, default=None, help="per dataset (default 16)")
    o.add_argument("--max-tokens", type=int, default=None, help="default 256")
    o.add_argument("--temperature", type=_floats, default=None, help="one or more, e.g. 0,1 (default 0)")
    o.add_argument("--gamma", type=int, default=7)
    o.add_argument("--thresholds", type=_floats, default=None, help="sweep for DSpark drafters (default 0.0..0.9)")
    o.add_argument("--sweep", type=_names, default=None,
                   help="the DSpark drafters (as listed in --drafters) to sweep (default: every one without @N)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--workload", choices=["datasets", "agent"], default="datasets",
                   help="agent: multi-turn agent traces (--num-prompts of them) instead of the datasets")
    o.set_defaults(func=run_offline)

    n = sub.add_parser("online", help="closed-loop clients: throughput vs per-user speed, verification budget")
    _common(n)
    n.add_argument("--configs", default=None, help="';'-separated 'none' or 'drafter:policy'")
    n.add_argument("--concurrency", type=_ints, default=None, help="default 1,2,4,8,16,32,64")
    n.add_argument("--requests-per-client", type=int, default=None, help="default 4")
    n.add_argument("--duration", type=float, default=None, help="send for this many seconds instead")
    n.add_argument("--repeats", type=int, default=None, help="runs per config and concurrency, rotating order (default 1)")
    n.add_argument("--lockstep", action="store_true",
                   help="within each run, step every config's engine in turn, each timed on its own clock "
                        "(all see the same machine at every moment; in-process only)")
    n.add_argument("--workload", choices=["mixed", "hostile", "agent"], default="mixed",
                   help="agent: multi-turn agent traces (--num-prompts of them), a table per task kind")
    n.add_argument("--datasets", type=_names, default=None)
    n.add_argument("--prompts", default=None, help="a JSONL prompts file instead of the shipped sets")
    n.add_argument("--num-prompts", type=int, default=None, help="per dataset (default 64)")
    n.add_argument("--max-tokens", type=int, default=None, help="default 128")
    n.add_argument("--temperature", type=float, default=0.0)
    n.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for sampled requests (default 1: off)")
    n.add_argument("--ignore-eos", action="store_true")
    n.add_argument("--gamma", type=int, default=None, help="cap every drafter's block size")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--profile", choices=["auto", "refresh", "off"], default="auto")
    n.add_argument("--sla", type=_floats, default=None, help="per-user tok/s levels for the summary")
    n.add_argument("--url", default=None, help="comma-separated running servers to load instead")
    n.add_argument("--trace", action="store_true",
                   help="keep every engine step (online-steps.jsonl) and add a table of steps by kind and load")
    n.set_defaults(func=run_online)

    q = sub.add_parser("peers", help="single stream vs transformers generate() (greedy, prompt lookup)")
    _common(q)
    q.add_argument("--num-prompts", type=int, default=None, help="per dataset (default 4)")
    q.add_argument("--max-tokens", type=int, default=None, help="default 128")
    q.add_argument("--repeats", type=int, default=None, help="alternating passes (default 1)")
    q.add_argument("--profile", choices=["auto", "refresh", "off"], default="auto")
    q.add_argument("--assistant", default=None,
                   help="also transformers assisted generation with this smaller model (same tokenizer)")
    q.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="also llama.cpp from this built source tree: plain, and with --assistant as its draft model")
    q.add_argument("--stop-at-eos", action="store_true",
                   help="every system stops at the model's end token (default: exactly --max-tokens each)")
    q.set_defaults(func=run_peers)

    k = sub.add_parser("soak", help="dspark serve under mixed load and faults: RSS and KV pool over time, errors")
    _common(k)
    k.add_argument("--duration", type=float, default=None, help="seconds of load (default 1200, --quick: 60)")
    k.add_argument("--clients", type=int, default=None, help="concurrent clients (default 12)")
    k.add_argument("--max-tokens", type=int, default=None, help="largest max_tokens a request asks (default 48)")
    k.add_argument("--num-kv-blocks", type=int, default=None, help="the server's KV pool (default 16: preempts)")
    k.add_argument("--sample-every", type=float, default=None, help="seconds between samples (default 10)")
    k.add_argument("--drafter", default=None)
    k.add_argument("--policy", default=None)
    k.add_argument("--seed", type=int, default=None)
    k.set_defaults(func=run_soak)
    h = sub.add_parser("host", help="per-step host time near the start vs the end of a long generation")
    h.add_argument("--max-tokens", type=int, default=4000)
    h.add_argument("--drafters", type=_names, default=["eagle3", "dspark", "ngram"], help="besides plain decoding")
    h.add_argument("--out", default=None, help="output directory (default docs/results/host)")
    h.set_defaults(func=run_host)

    a = sub.add_parser("steps", help="the anatomy of a drafted step against a plain one, side by side")
    _common(a)
    a.add_argument("--configs", type=_configs, default=None,
                   help="';'-separated: none;DRAFTER:POLICY[@N] (default none;dspark:static:7;dspark:dspark)")
    a.add_argument("--num-prompts", type=int, default=None, help="per dataset (gsm8k, humaneval, mt-bench)")
    a.add_argument("--max-tokens", type=int, default=None)
    a.add_argument("--repeats", type=int, default=None)
    a.add_argument("--concurrency", type=int, default=None, help="requests stepped together (default 1)")
    a.set_defaults(func=run_steps)

    x = sub.add_parser("exact", help="greedy output of every drafter x policy against plain decoding, alone and batched")
    _common(x)
    x.add_argument("--configs", type=_configs, default=None,
                   help="';'-separated DRAFTER:POLICY (default: every drafter x static:7 and dspark)")
    x.add_argument("--num-prompts", type=int, default=None, help="per dataset (gsm8k, humaneval, mt-bench; default 4)")
    x.add_argument("--max-tokens", type=int, default=None, help="default 128")
    x.add_argument("--concurrency", type=_ints, default=None, help="prompts started together (default 1,12)")
    x.set_defaults(func=run_exact)

    t = sub.add_parser("goals", help="the project's benchmark goals checked against committed results (measures nothing)")
    t.add_argument("--results", default=None, help="results tree with offline/, online/, peers/ (default docs/results)")
    t.set_defaults(func=run_goals)


def _given(args: argparse.Namespace, **names: str) -> dict:
    """Settings fields from the arguments the user set (None: keep the default or preset)."""
    return {field: getattr(args, arg) for field, arg in names.items() if getattr(args, arg) is not None}


def run_decode(args: argparse.Namespace) -> int:
    from dspark.bench import decode

    if args.quick:
        args.concurrency, args.max_tokens, args.repeats = [1, 4], 16, 1
    decode.run(args.model, args.concurrency, args.max_tokens, args.repeats, _out(args, "decode"))
    return 0


def run_offline(args: argparse.Namespace) -> int:
    from dspark.bench import offline

    fields = dict(offline.QUICK) if args.quick else {}
    fields.update(_given(args, model="model", device="device", prompts_file="prompts", num_prompts="num_prompts",
                         max_tokens="max_tokens", gamma="gamma", seed="seed", workload="workload"))
    for field, arg in (("drafters", "drafters"), ("datasets", "datasets"), ("temperatures", "temperature"),
                       ("thresholds", "thresholds"), ("sweep", "sweep")):
        if getattr(args, arg) is not None:
            fields[field] = tuple(getattr(args, arg))
    offline.run(offline.OfflineSettings(**fields), _out(args, "offline"))
    return 0


def run_online(args: argparse.Namespace) -> int:
    from dspark.bench import online
    from dspark.sampling import SamplingParams

    fields: dict = {}
    if args.quick:
        fields = dict(concurrency=(1, 4), requests_per_client=2, num_prompts=4, max_tokens=16,
                      configs=online.quick_configs(args.model) if not args.url else online.CONFIGS)
    fields.update(_given(args, model="model", device="device", configs="configs", requests_per_client="requests_per_client",
                         duration_s="duration", repeats="repeats", prompts_file="prompts", num_prompts="num_prompts",
                         max_tokens="max_tokens", gamma="gamma", url="url"))
    SamplingParams(temperature=args.temperature, top_p=args.top_p)  # bad sampling settings fail before any model loads
    fields.update(workload=args.workload, temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos,
                  seed=args.seed, profile=args.profile, lockstep=args.lockstep, trace=args.trace)
    for field, arg in (("concurrency", "concurrency"), ("datasets", "datasets"), ("slas", "sla")):
        if getattr(args, arg) is not None:
            fields[field] = tuple(getattr(args, arg))
    online.run(online.OnlineSettings(**fields), _out(args, "online"))
    return 0


def run_peers(args: argparse.Namespace) -> int:
    from dspark.bench import peers

    fields = dict(peers.QUICK) if args.quick else {}
    fields.update(_given(args, model="model", device="device", num_prompts="num_prompts", max_tokens="max_tokens",
                         repeats="repeats", profile="profile", assistant="assistant",
                         llama_cpp="llama_cpp"))
    peers.run(peers.PeersSettings(**fields, stop_at_eos=args.stop_at_eos), _out(args, "peers"))
    return 0


def run_soak(args: argparse.Namespace) -> int:
    """Exit status 1 when the soak saw errors or left KV blocks in use."""
    from dspark.bench import soak
    from dspark.report import DEFAULT_OUT

    fields = dict(duration_s=60.0, sample_every_s=5.0) if args.quick else {}
    fields.update(_given(args, model="model", device="device", duration_s="duration", clients="clients",
                         max_tokens="max_tokens", num_kv_blocks="num_kv_blocks", sample_every_s="sample_every",
                         drafter="drafter", policy="policy", seed="seed"))
    out = args.out or ("/tmp/dspark-bench-quick/soak" if args.quick else f"{DEFAULT_OUT}/soak")
    data = soak.run(soak.SoakSettings(**fields), out)
    print(f"soak: {data['errors']} errors, KV blocks in use after the load: "
          f"{data['server']['kv_blocks_used_after_load']}, RSS {data['rss_mib']} MiB; report in {out}")
    return 1 if data["errors"] or data["server"]["kv_blocks_used_after_load"] else 0


def run_goals(args: argparse.Namespace) -> int:
    from dspark.bench import goals
    from dspark.report import DEFAULT_OUT

    goals.run(args.results or DEFAULT_OUT)  # reads <results>/<benchmark>/, writes <results>/goals/
    return 0


def run_host(args: argparse.Namespace) -> int:
    from dspark.bench import host
    from dspark.report import DEFAULT_OUT

    host.run(host.HostSettings(max_tokens=args.max_tokens, drafters=tuple(args.drafters)), args.out or f"{DEFAULT_OUT}/host")
    return 0


def run_exact(args: argparse.Namespace) -> int:
    """Exit status 1 where a configuration parted from plain decoding with each prompt alone."""
    from dspark.bench import exact

    fields = {"num_prompts": 1, "max_tokens": 24, "concurrency": (1, 2)} if args.quick else {}
    fields.update(_given(args, model="model", device="device", num_prompts="num_prompts", max_tokens="max_tokens"))
    if args.concurrency is not None:
        fields["concurrency"] = tuple(args.concurrency)
    if args.configs is not None:
        fields["configs"] = tuple(args.configs)
    data = exact.run(exact.ExactSettings(**fields), _out(args, "exact"))
    print(exact.markdown(data))
    return 0 if data["alone_exact"] else 1


def run_steps(args: argparse.Namespace) -> int:
    from dspark.bench import steps
    from dspark.report import cell

    fields = {"num_prompts": 1, "max_tokens": 16, "repeats": 1} if args.quick else {}
    fields.update(_given(args, model="model", device="device", num_prompts="num_prompts", max_tokens="max_tokens",
                         repeats="repeats", concurrency="concurrency"))
    if args.configs is not None:
        fields["configs"] = tuple(args.configs)
    data = steps.run(steps.StepsSettings(**fields), _out(args, "steps"))
    for name, r in data["results"].items():
        print(f"{name:28s} {r['tok_s']:7.1f} tok/s  x{r['speedup']:.2f}  proposal/plain {cell(r['proposal_over_plain'], 2)}"
              f"  drafted/plain {cell(r['drafted_over_plain'], 2)}")
    return 0
