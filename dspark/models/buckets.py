"""Sizes rounded up to a few buckets, so the CPU's oneDNN kernels are built once and reused.

On CPU in bfloat16 the products (`fused.Product`) and attention's batched products run through
oneDNN, which builds a kernel (a "primitive") for every new shape and caches it. Building one took
0.7-2 ms on a 2-core CPU, many times what the product itself costs at a few tokens, and a serving
step's shapes keep changing: the number of tokens in the forward, the longest context in an
attention grid. A probe at 16 requests (two requests drafting beside fourteen decoding) met about
twelve new shapes and spent 15-18 ms of its 57 ms building kernels, where a plain step took 21 ms.
Padded up to one of four sizes per octave (at most 25% more rows or keys, masked or dropped; at
these sizes a product costs about the same with a few more rows), the shapes a run meets are few
enough that most steps find their kernels built.
"""

from __future__ import annotations


def bucket(n: int, exact: int = 16, largest: int = 256) -> int:
    """n rounded up to a multiple of 2^(bits(n) - 3), four sizes per octave; sizes up to `exact`
    (built quickly, met all the time) and above `largest` (where building is small beside the work)
    stay as they are."""
    if n <= exact or n > largest:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step
