"""The mutation list: plausible bugs that each gate must catch, one module per scope (where the
bug is planted: inside the fleet's ranks, in the gate's own process, or in the source both
share). gates/mutations.py plants them and runs their gates."""

from gates.mutation_list import fleet, held, process, source
from gates.mutation_list.common import Mutation

MUTATIONS: list[Mutation] = [
    *fleet.MUTATIONS,
    *process.MUTATIONS,
    *source.MUTATIONS,
    *held.MUTATIONS,
]
BY_NAME = {m.name: m for m in MUTATIONS}
