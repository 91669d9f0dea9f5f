"""For workers that train without rolling out: a scored batch (two responses of random tokens per prompt,
their lengths and advantages set by the step, the same on every rank), and an AdamW made linear in the
gradients, for comparing updates whose gradients differ by rounding."""
import torch

from roles.rollout import Sample


def scored_batch(prompts: list[list[int]], step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(step)
    samples = []
    for i, ids in enumerate(prompts):
        for g in range(2):
            response = torch.randint(2, 64, (3 + i + g,), generator=gen).tolist()
            samples.append(Sample(i, g, ids, response, [-3.0] * len(response), "length",
                                  advantage=1.0 if (i + g + step) % 2 else -1.0))
    return samples


def well_conditioned(trainer) -> None:
    """AdamW's first step moves a weight by lr * g / (|g| + eps): with the default eps (1e-8) a gradient
    near 1e-8 whose last bits rounding changes moves its weight by a different amount, which a later
    minibatch or step then starts from. With eps = 1 the step is lr * g / (|g| + 1), within lr of the
    gradient's own change; lr = 0.1 moves the weights by a few parts in a thousand, as a real step does."""
    for group in trainer.optimizer.param_groups:
        group.update(lr=0.1, eps=1.0)
