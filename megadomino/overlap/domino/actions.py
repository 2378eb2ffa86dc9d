"""Domino's schedule as data: the actions one forward and one backward of the layer stack run,
in order, for L layers, N batch slices and K hidden chunks. The executor (schedule.py) runs this
list and nothing else, so the printed list is the schedule (the paper's overlap figure, as a
table).

Actions (`Action(pass_, op, layer, slice)`, printed one a line by `table`; `reduces` names the
async reduction a compute action launches on the TP group when it finishes, `waits` the one a
wait consumes):

    forward   glue_in     x = h + dropout(m + b_fc2) of the previous layer, u = ln1(x)
              attention   this rank's partial attention output of u   -> launches reduce(a)
              glue_mid    h = x + dropout(reduce(a) + b_proj), v = ln2(h)
              mlp         the K chunks' partial MLP outputs of v      -> launches reduce(m_k)
              glue_out    y = h + dropout(reduce(m) + b_fc2) of the last layer
    backward  the same units in reverse; mlp / attention launch the reduce of their input's
              gradient (dv / du) and then run their deferred weight-gradient GEMMs, which
              overlap it; recompute rebuilds a layer's forward graphs (--recompute-granularity
              full); flush hands a layer's summed parameter gradients to autograd (in the
              runner's capture mode, the block's node returns them at the end instead).
    wait      block until the named reduction has finished (the only synchronisation).

A reduction launched by slice i is waited only after the other slices' work of the same stage
was enqueued, so slice i's communication overlaps slice i+1's GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    pass_: str                 # "F" or "B"
    op: str                    # glue_in attention glue_mid mlp glue_out wait recompute flush
    layer: int | None = None
    slice: int | None = None
    waits: str | None = None   # wait: a, m (forward), dv, du (backward)
    chunks: int = 1            # forward mlp: K hidden chunks, each reduce launched when computed

    @property
    def reduces(self) -> str | None:
        """The reduction this compute action launches when it finishes, if any."""
        if self.op in ("attention", "mlp"):
            return {("F", "attention"): "a", ("F", "mlp"): "m", ("B", "mlp"): "dv",
                    ("B", "attention"): "du"}[(self.pass_, self.op)]
        return None

    def __str__(self) -> str:
        where = " ".join(f"{name}{value}" for name, value in (("L", self.layer),
                                                              ("S", self.slice))
                         if value is not None)
        what = f"wait {self.waits}" if self.op == "wait" else self.op
        if self.chunks > 1:
            what += f" x{self.chunks} chunks"
        if self.reduces:
            what += f" -> reduce {self.reduces}" + (" each" if self.chunks > 1 else "") + (
                " + weight grads" if self.pass_ == "B" else "")
        return f"{self.pass_} {where:<5} {what}"


def forward_actions(layers: int, slices: int, chunks: int = 1) -> list[Action]:
    out: list[Action] = []
    for layer in range(layers):
        for i in range(slices):
            if layer > 0:
                out.append(Action("F", "wait", layer - 1, i, "m"))
            out += [Action("F", "glue_in", layer, i), Action("F", "attention", layer, i)]
        for i in range(slices):
            out += [Action("F", "wait", layer, i, "a"), Action("F", "glue_mid", layer, i),
                    Action("F", "mlp", layer, i, chunks=chunks)]
    for i in range(slices):
        out += [Action("F", "wait", layers - 1, i, "m"), Action("F", "glue_out", None, i)]
    return out


def backward_actions(layers: int, slices: int, recomputed: frozenset[int] = frozenset()
                     ) -> list[Action]:
    out = [Action("B", "glue_out", None, i) for i in range(slices)]
    for layer in reversed(range(layers)):
        if layer in recomputed:
            out.append(Action("B", "recompute", layer))
        for i in range(slices):
            if layer < layers - 1:
                out += [Action("B", "wait", layer + 1, i, "du"),
                        Action("B", "glue_in", layer + 1, i)]
            out.append(Action("B", "mlp", layer, i))
        if layer < layers - 1:
            out.append(Action("B", "flush", layer + 1))
        for i in range(slices):
            out += [Action("B", "wait", layer, i, "dv"), Action("B", "glue_mid", layer, i),
                    Action("B", "attention", layer, i)]
    for i in range(slices):
        out += [Action("B", "wait", 0, i, "du"), Action("B", "glue_in", 0, i)]
    out.append(Action("B", "flush", 0))
    return out


def table(actions: list[Action]) -> str:
    """One action a line, numbered: what tests compare with a golden table and a user prints."""
    return "\n".join(f"{n:3d} {action}" for n, action in enumerate(actions)) + "\n"
