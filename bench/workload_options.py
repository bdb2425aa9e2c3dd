"""The workload options the benchmarks share (`--workload`, the trace's, the generators') and the workload they
name; kept apart from bench/compare.py so that a simulation's processes need no HTTP client to read them."""

from __future__ import annotations

import argparse

from bench import traces, workloads
from bench.make_model import ROOT
from bench.workloads import PromptVocabulary, Workload

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=["mooncake", "tenants", "multi_turn", "rag", "no_overlap"], default="tenants")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL trace")
    g.add_argument("--limit", type=int, default=200, help="trace: requests replayed")
    g.add_argument("--offset", type=int, default=0, help="trace: records skipped first")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: replay this many times faster")
    g.add_argument("--block-tokens", type=int, default=None,
                   help="trace: tokens per hash_id (default: the trace's own, 512 in Mooncake's; smaller shrinks "
                        "every prompt alike)")
    g.add_argument("--max-output-tokens", type=int, default=None, help="trace: cap on output_length")
    g.add_argument("--tenants", type=int, default=8)
    g.add_argument("--prefix-tokens", type=int, default=512, help="tenants: system prompt length P")
    g.add_argument("--users", type=int, default=4, help="tenants: users per tenant U")
    g.add_argument("--question-tokens", type=int, default=32, help="tenants/multi_turn/rag: question length Q")
    g.add_argument("--requests-per-user", type=int, default=3)
    g.add_argument("--sessions", type=int, default=16, help="multi_turn: conversations")
    g.add_argument("--system-tokens", type=int, default=256, help="multi_turn: system prompt length")
    g.add_argument("--turns", type=int, default=5)
    g.add_argument("--answer-tokens", type=int, default=32)
    g.add_argument("--idle-s", type=float, default=2.0, help="multi_turn: mean gap between turns")
    g.add_argument("--documents", type=int, default=48, help="rag: document pool")
    g.add_argument("--document-tokens", type=int, default=384)
    g.add_argument("--zipf", type=float, default=1.1)
    g.add_argument("--requests", type=int, default=128, help="rag / no_overlap: requests")
    g.add_argument("--prompt-tokens", type=int, default=512, help="no_overlap: prompt length")
    g.add_argument("--max-tokens", type=int, default=8, help="generators: tokens generated per request")


def build_workload(args: argparse.Namespace, vocab: PromptVocabulary) -> Workload:
    if args.workload == "mooncake":
        return traces.mooncake_workload(args.trace, vocab, limit=args.limit, offset=args.offset,
                                           time_scale=args.time_scale, block_tokens=args.block_tokens,
                                           max_output_tokens=args.max_output_tokens)
    if args.workload == "tenants":
        return workloads.tenants(vocab, tenants=args.tenants, prefix_tokens=args.prefix_tokens, users=args.users,
                                 question_tokens=args.question_tokens, requests_per_user=args.requests_per_user,
                                 max_tokens=args.max_tokens, seed=args.seed)
    if args.workload == "multi_turn":
        return workloads.multi_turn(vocab, sessions=args.sessions, turns=args.turns,
                                    system_tokens=getattr(args, "system_tokens", 256),
                                    question_tokens=args.question_tokens, answer_tokens=args.answer_tokens,
                                    idle_s=args.idle_s, seed=args.seed)
    if args.workload == "rag":
        return workloads.rag(vocab, documents=args.documents, document_tokens=args.document_tokens,
                             zipf_s=args.zipf, question_tokens=args.question_tokens, requests=args.requests,
                             max_tokens=args.max_tokens, seed=args.seed)
    return workloads.no_overlap(vocab, requests=args.requests, prompt_tokens=args.prompt_tokens,
                                max_tokens=args.max_tokens, seed=args.seed)
