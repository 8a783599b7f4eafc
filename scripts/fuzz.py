"""Fuzz convert-bnb with mutated fixture files: as many cases as asked, spread over every kind.

Every case must end in a correct conversion (bit-exact with an independent reference computed
from the mutated input, and loading with the safetensors library or gguf-py's reader) or in one of
convert-bnb's own errors, with no output or temporary left behind and the input unchanged;
``inspect`` and ``--dry-run`` must end in a report or one of our errors, and ``convert-bnb check``
must agree (clean exactly when the conversion succeeds, naming the rule it failed on); anything
else stops the run with hypothesis's falsifying example.
See tests/helpers/fuzzing.py for the byte-level mutations and the oracle, tests/helpers/fuzzing_struct.py for the
structure-aware kinds of fields (fields of the QuantState / header / config / index JSON set to
extreme values and wrong types, companion tensors swapped between layers, absmax dtypes, GGUF
config and tokenizer fields, adapter configs, patterns and non-finite adapter tensors) and
tests/helpers/fuzzing_names.py for those of names (pickle strings, index names, the files of a
model directory).

    python scripts/fuzz.py --cases 20000            # a fresh random seed (printed)
    python scripts/fuzz.py --cases 2000 --seed 7    # reproducible
    python scripts/fuzz.py --cases 500 --kind truncate
    python scripts/fuzz.py --cases 10500 --even --kind struct-quant-state --kind struct-companions \
        --kind struct-gguf-config --kind struct-adapter --kind struct-pickle-strings \
        --kind struct-index-names --kind struct-shard-paths   # the structure-aware fuzzer alone
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000, help="total cases (default 2000)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    ap.add_argument("--kind", action="append", help="only these mutation kinds (repeatable)")
    ap.add_argument("--even", action="store_true",
                    help="the same number of cases for every kind (default: in the proportions CI runs them)")
    ap.add_argument("--no-shrink", action="store_true",
                    help="report a failing case as found, without minimising it (slow struct-* cases)")
    ap.add_argument("--max-address-space", type=float, default=4.0, metavar="GIB",
                    help="cap the process's address space (RLIMIT_AS, GiB; 0 = no cap) so that a runaway "
                         "allocation fails the case instead of exhausting the machine (default 4)")
    args = ap.parse_args()
    if args.max_address_space > 0:
        import resource

        cap = int(args.max_address_space * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    sys.path.insert(0, str(ROOT))
    from tests.helpers.fuzzing import CI_CASES, KINDS, OUTCOMES, property_test

    kinds = args.kind or KINDS
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kind(s) {sorted(unknown)}; choose from {KINDS}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    weights = {k: 1 if args.even else CI_CASES[k] for k in kinds}
    total_w = sum(weights.values())
    share = {k: args.cases * w // total_w for k, w in weights.items()}
    share[kinds[0]] += args.cases - sum(share.values())
    print(f"fuzz: {args.cases} cases, seed {seed}: " + ", ".join(f"{k} {n}" for k, n in share.items()), flush=True)
    t0 = time.perf_counter()
    for k in kinds:
        t = time.perf_counter()
        property_test(k, share[k], derandomize=False, seed=seed, shrink=not args.no_shrink)()
        c = OUTCOMES[k]
        print(f"  {k:<21} {sum(c.values()):>6} cases in {time.perf_counter() - t:6.1f} s: ok {c['ok']}, "
              + ", ".join(f"{r} {n}" for r, n in sorted(c.items()) if r != "ok"), flush=True)
    ran = sum(sum(c.values()) for c in OUTCOMES.values())
    ok = sum(c["ok"] for c in OUTCOMES.values())
    rules = sorted({r for c in OUTCOMES.values() for r in c if r != "ok"})
    print(f"fuzz: {ran} cases passed in {time.perf_counter() - t0:.1f} s (seed {seed}): {ok} correct conversions, "
          f"{ran - ok} clean errors over {len(rules)} rules ({', '.join(rules)}); no other exception, no hang, "
          "nothing left behind, inputs unchanged, every output loaded with the safetensors library or gguf-py, "
          "inspect and --dry-run ended in a report or a rule, `check` agreed every time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
