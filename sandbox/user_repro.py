"""The self-contained repro script of a user kernel: `mlasandbox repro`'s paged script
(repro.render_paged_script), with the kernel's source (its includes inlined, the contract's
checks appended) and its -D options embedded."""
from __future__ import annotations

from dataclasses import dataclass

from . import registry
from .dims import PRESETS
from .paged_api import check_page_size, plan_for_lengths
from .paged_inputs import check_inputs_fit, parse_lengths
from .repro import PAGED_SPARE_PAGES, PagedReproCase, write_paged_script

__all__ = ["UserReproCase", "check_user_case", "make_user_case", "write_user_script"]


@dataclass(frozen=True)
class UserReproCase(PagedReproCase):
    user: object = None        # the UserKernel

    def instances(self):
        return (self.user.instance(self.cache_dtype, self.q_dtype),
                registry.paged_combine_instance(self.cache_dtype, True))

    def attn_writes_single(self) -> bool:
        return False   # a user kernel may write partials only: every request is merged


def check_user_case(*, batch: int = 4, lengths="0,20,4097,1000", s_q: int = 1,
                    page_size: int = 64, heads: int = 16, seed: int = 0) -> tuple:
    """(dims, lengths) of the case make_user_case builds with these arguments, or the
    ValueError it would raise: a case its script could not hold is refused as `repro`
    refuses it, before any compile."""
    dims = PRESETS["dsv3"].with_heads(heads)
    lens = tuple(int(n) for n in parse_lengths(lengths, batch, seed))
    check_page_size(page_size)
    check_inputs_fit(lens, s_q, page_size, dims, PAGED_SPARE_PAGES)  # as `repro` does
    return dims, lens


def make_user_case(kernel, *, batch: int = 4, lengths="0,20,4097,1000", s_q: int = 1,
                   causal: bool = False, page_size: int = 64, heads: int = 16,
                   cache: str = "f16", q: str = "f32", seed: int = 0, num_sms: int = 132,
                   blocks_per_sm: int = 1, command: str = "") -> UserReproCase:
    """A batched paged case of `kernel` (a UserKernel of kind attn), its chunk plan pinned
    (paged_api.plan_for_lengths with `num_sms` and `blocks_per_sm`: the result does not
    depend on it)."""
    if kernel.kind != "attn":
        raise ValueError(f"{kernel.path}: the repro script replays the attention phase and the "
                         "built-in combine; a kind=step kernel has no repro script yet")
    dims, lens = check_user_case(batch=batch, lengths=lengths, s_q=s_q, page_size=page_size,
                                 heads=heads, seed=seed)
    inst = kernel.instance(cache, q)
    n_rows = s_q * dims.n_head
    plan = plan_for_lengths(lens, page_size, n_rows, inst, num_sms=num_sms,
                            blocks_per_sm=blocks_per_sm)
    return UserReproCase(
        variant=kernel.stem, dims=dims, lengths=lens, lengths_spec=str(lengths), s_q=int(s_q),
        causal=bool(causal), page_size=int(page_size), cache_dtype=cache, q_dtype=q,
        plan={"max_chunks": plan.max_chunks, "min_chunk": plan.min_chunk, "tile": plan.tile,
              "rows_per_block": inst.heads, "target": plan.target,
              "programs": plan.programs_per_block},
        plan_from=f"{plan.reason}; plan_chunks with {num_sms} SMs and {blocks_per_sm} "
                  "blocks/SM", seed=int(seed), scale=dims.default_scale, command=command,
        user=kernel)


def write_user_script(case: UserReproCase, path: str) -> str:
    return write_paged_script(case, path)
