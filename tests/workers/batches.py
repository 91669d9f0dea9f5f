"""A scored batch for workers that train without rolling out: two responses of random tokens per prompt,
their lengths and advantages set by the step, the same on every rank."""
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
