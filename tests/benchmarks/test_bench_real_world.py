"""benchmarks/real_world.py builds its cases from the tests' shared models (tests/support):
the ResNet-like case imports, builds and compiles on one device."""
import real_world  # noqa: E402


def test_resnet_case_builds_from_the_shared_test_models():
    step, args, batch_argnums, temp = real_world._resnet()
    assert batch_argnums == (1,) and len(args) == 2 and temp > 0
