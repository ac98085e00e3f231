"""What the tests share: the steps and models they run (`steps`, `layer_models`,
`nnx_models`, `stage_mlp`), the comparison rule against jax.jit (`equivalence`), HLO reading
(`hlo`), the multi-process worker (`mp_worker`), and the repository's root (`REPO`)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
