"""Write the HTML report of a demo plan and take a PNG screenshot of it with headless Chromium
(the picture in the README).

Run from the repository root:

    python examples/report_screenshot.py                    # 2-stage GPT pipeline
    python examples/report_screenshot.py --single-mesh      # the demo's one-mesh ShardParallel

It plans the GPT of examples/train_gpt.py on 8 simulated CPU devices as a 2-stage pipeline
(1F1B, 4 microbatches) over a 2 x 4 mesh (or, with --single-mesh, as the demo does), writes
the report (`autopar.report`) to examples/report.html and, when `chromium` (or
`chromium-browser`) is on PATH, a screenshot to examples/report.png. Open the HTML file in any
browser: it needs no network.
"""
import argparse
import os
import shutil
import subprocess
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))

import jax  # noqa: E402
from train_gpt import BATCH_SIZE, CONFIG, create_state  # noqa: E402  (the demo's model)

import autopar  # noqa: E402
from autopar.models.gpt import gpt_loss, make_gpt_batch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def train_step(state, batch):
    """examples/train_gpt.py's step with `autopar.value_and_grad`, which pipelines need."""
    def loss_fn(params):
        return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def screenshot(html_path: str, png_path: str, size: str = "1280,2000") -> bool:
    """A PNG of the page by headless Chromium; False (with a message) when there is none."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        print("no chromium on PATH (Debian: apt-get install chromium): no screenshot taken")
        return False
    subprocess.run([exe, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                    f"--screenshot={png_path}", f"--window-size={size}",
                    f"file://{os.path.abspath(html_path)}"],
                   check=True, capture_output=True, timeout=120)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single-mesh", action="store_true",
                    help="plan one ShardParallel mesh instead of a 2-stage pipeline")
    ap.add_argument("--html", default=os.path.join(HERE, "report.html"))
    ap.add_argument("--png", default=os.path.join(HERE, "report.png"))
    ap.add_argument("--window-size", default="1280,2000")
    args = ap.parse_args()

    key = jax.random.key(0)
    state = create_state(key)
    batch = make_gpt_batch(jax.random.fold_in(key, 1), BATCH_SIZE, CONFIG)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    method = autopar.ShardParallel() if args.single_mesh else autopar.PipeshardParallel(
        num_microbatches=4, schedule=autopar.Schedule.ONE_F_ONE_B,
        layer_option=autopar.AutoLayerOption(num_layers=CONFIG.num_layers),
        stage_option=autopar.UniformStageOption(num_stages=2))
    step = autopar.parallelize(train_step, mesh=mesh, method=method, batch_argnums=(1,))
    plan = step.get_plan(state, batch)
    print(autopar.summary(plan))
    autopar.report(plan, args.html)
    print(f"wrote {os.path.relpath(args.html)}")
    if screenshot(args.html, args.png, args.window_size):
        print(f"wrote {os.path.relpath(args.png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
