#!/usr/bin/env python3
"""Break KV reuse on purpose, to prove the tests catch it (issue 18's sabotage runs).

Each break is one small edit of ``kvturn/connector/nixl.py``; ``scripts/break_reuse.sh`` applies
them one at a time in a scratch clone, starts an engine pair with the broken connector, runs
the reuse tests and puts the file back. Never run it in a checkout you are working in.

    scripts/break_reuse.py list
    scripts/break_reuse.py apply NAME
"""

from __future__ import annotations

import sys
from pathlib import Path

CONNECTOR = Path(__file__).resolve().parent.parent / "kvturn" / "connector" / "nixl.py"

#: name -> (what it breaks, text replaced, replacement)
BREAKS: dict[str, tuple[str, str, str]] = {
    "skip-verify": (
        "prefill pulls whatever decode holds, never checking the prefix digests",
        """        if digests is None:
            # No proof of what the decode holds: never pull unverified KV.
            verified = 0
        else:
            verified = common_prefix_tokens(digests, prompt, DIGEST_CHUNK_TOKENS)""",
        """        verified = held  # BROKEN ON PURPOSE: no verification""",
    ),
    "one-block-too-many": (
        "prefill pulls one block past the verified common prefix",
        """        usable = max(0, min(verified, held, len(prompt) - 1))""",
        """        usable = max(0, min(verified + self._block_size, held, len(prompt) - 1))""",
    ),
    "wrong-blocks": (
        "prefill pulls the right number of blocks in the wrong order (wrong KV, right size)",
        """                list(group)[:num_blocks] for group in params["remote_block_ids"]""",
        '                list(group)[:num_blocks][::-1] for group in params["remote_block_ids"]',
    ),
    "local-not-freed": (
        "decode-local turns are not named to NIXL's worker: their blocks are never freed",
        """            meta.reqs_in_batch.update(self._local)
""",
        """            pass  # BROKEN ON PURPOSE: meta.reqs_in_batch.update(self._local)
""",
    ),
    "stop-string-dropped": (
        "turns that end on a stop string keep no KV (upstream's behaviour)",
        """        stopped_by_server = _aborted_after_decoding(request)
""",
        """        stopped_by_server = False  # BROKEN ON PURPOSE
""",
    ),
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        for name, (what, _, _) in BREAKS.items():
            print(f"{name}: {what}")
        return 0
    if len(argv) != 2 or argv[0] != "apply" or argv[1] not in BREAKS:
        print(__doc__, file=sys.stderr)
        return 2
    _, old, new = BREAKS[argv[1]]
    text = CONNECTOR.read_text()
    if text.count(old) != 1:
        print(f"{argv[1]}: the code it breaks is not in {CONNECTOR} (changed?)", file=sys.stderr)
        return 1
    CONNECTOR.write_text(text.replace(old, new))
    print(f"broke {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
