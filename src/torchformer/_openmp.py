"""How long torch's OpenMP threads wait busy between parallel regions: set before torch loads.

A decode step is hundreds of short parallel regions (each product, each kernel inductor fused) with
a little Python between them. libgomp (torch's OpenMP on Linux) lets an idle thread spin 300,000
iterations before it sleeps on a futex, and waking a sleeping thread costs more than a small
region's work: on a 2-core AVX2 EPYC the toy shape's int4 decode ran as fast on one thread as on
two (446 against 438 tok/s). With GOMP_SPINCOUNT=3000000 two threads reached 504 (+19%), and the
Llama-3.2-1B shape's int4 decode 30.5 -> 32.5 tok/s; OMP_WAIT_POLICY=ACTIVE (spin forever) 517, but
an idle server would then keep every core busy. llama.cpp's threads spin the same way.

libgomp reads the variable once, when torch loads it, so it is set here only where torchformer is
imported before torch (the ``torchformer`` command, ``import torchformer`` first) and neither it nor
OMP_WAIT_POLICY is set already. After ~3M spins an idle thread sleeps as before.
"""

import os
import sys

SPIN_COUNT = "3000000"

if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
