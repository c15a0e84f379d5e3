"""RL-style weight sync over tensorwire: a trainer actor updates its weights each step and
pushes them to inference actors (on other nodes, where the cluster has them) with
``tensor_transport="tensorwire"``; each inference actor checks that it holds exactly the
trainer's weights of that step.

    python python/examples/ray_weight_sync.py                   # a local Ray
    python python/examples/ray_weight_sync.py --address auto    # a running cluster

PyTorch tensors where PyTorch is installed (CUDA ones on actors given a GPU with --gpus),
NumPy arrays otherwise.
"""

import argparse
import hashlib
import time

import numpy as np
import ray

import tensorwire.ray

try:
    import torch
except ImportError:
    torch = None


def checksum(weights):
    """A hash of every tensor's name and bytes, the same on every actor."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name]
        raw = tensor.cpu().contiguous().view(-1).view(torch.uint8).numpy() if torch else tensor.view(np.uint8)
        digest.update(name.encode())
        digest.update(raw.tobytes())
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", help="a Ray cluster to join ('auto': the one on this node; 'local': always a new one)"
    )
    parser.add_argument("--inference-actors", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layer-mib", type=float, default=4.0, help="size of each layer's weights")
    parser.add_argument("--gpus", type=float, default=0, help="GPUs per actor (CUDA tensors)")
    args = parser.parse_args()

    # A local Ray gets a CPU slot per actor, so that all start on a small machine too.
    starts_ray = args.address in (None, "local")
    ray.init(address=args.address, num_cpus=args.inference_actors + 1 if starts_ray else None)
    # Before the actor classes: Ray checks the transport's name where the methods are defined.
    tensorwire.ray.register()
    device = "cuda" if args.gpus else "cpu"
    elements = int(args.layer_mib * (1 << 20)) // 4

    @ray.remote(num_gpus=args.gpus)
    class Trainer:
        def __init__(self):
            self.step = 0
            self.weights = {}
            for i in range(args.layers):
                self.weights[f"layer{i}.weight"] = self._tensor(np.zeros(elements, np.float32))

        def _tensor(self, array):
            return torch.from_numpy(array).to(device) if torch else array

        def train_step(self):
            """Stands in for an optimiser step: every weight changes."""
            self.step += 1
            rng = np.random.default_rng(self.step)
            for name in self.weights:
                self.weights[name] = self._tensor(rng.standard_normal(elements, dtype=np.float32))
            return self.step, checksum(self.weights)

        @ray.method(tensor_transport="tensorwire")
        def latest_weights(self):
            return self.weights

    # Receivers of tensors need Ray's transfer thread.
    @ray.remote(num_gpus=args.gpus, enable_tensor_transport=True)
    class Inference:
        def load(self, step, weights):
            self.step, self.weights = step, weights
            return step, checksum(weights)

    trainer = Trainer.remote()
    servers = [Inference.remote() for _ in range(args.inference_actors)]
    total = args.layers * elements * 4
    for _ in range(args.steps):
        step, expected = ray.get(trainer.train_step.remote())
        started = time.monotonic()
        weights = trainer.latest_weights.remote()
        loaded = ray.get([server.load.remote(step, weights) for server in servers])
        seconds = time.monotonic() - started
        assert all(got == (step, expected) for got in loaded), f"step {step}: {loaded} != {expected}"
        print(
            f"step {step}: {total / (1 << 20):.0f} MiB of weights on {len(servers)} inference actors "
            f"in {seconds * 1000:.0f} ms, every copy identical"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
