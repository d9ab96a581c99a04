"""A deterministic instruction-prompt set for training and benchmarking draft heads.

Prompts are templates crossed with topic lists (general topics for explanations,
poems, lists and comparisons; programming tasks for code), shuffled with a fixed
seed and split into a training part and a held-out part. The held-out prompts
never appear in training, so acceptance measured on them (scripts/train_eagle.py,
benchmarks) says how the head generalises rather than how well it memorised.
The set is built from Python literals only, so it is identical on every machine.
"""

from __future__ import annotations

import itertools
import random

TOPICS = [
    "photosynthesis",
    "black holes",
    "the water cycle",
    "volcanoes",
    "the human heart",
    "electricity",
    "gravity",
    "the moon",
    "rainbows",
    "honeybees",
    "the Roman Empire",
    "the printing press",
    "climate change",
    "vaccines",
    "the internet",
    "dinosaurs",
    "the ocean tides",
    "earthquakes",
    "the solar system",
    "magnets",
    "recycling",
    "the immune system",
    "coral reefs",
    "the pyramids of Egypt",
    "machine learning",
    "democracy",
    "the stock market",
    "music theory",
    "chess",
    "coffee",
    "the Amazon rainforest",
    "penguins",
    "clouds",
    "bread baking",
    "the French Revolution",
    "DNA",
    "renewable energy",
    "the Olympic Games",
    "friendship",
    "sleep",
]

GENERAL_TEMPLATES = [
    "Explain {topic} to a child.",
    "Write a short poem about {topic}.",
    "List three facts about {topic}.",
    "Give a one-paragraph summary of {topic}.",
    "What are the most common misconceptions about {topic}?",
    "Write a haiku about {topic}.",
    "Describe {topic} in simple terms for a beginner.",
    "Why is {topic} important? Answer in two sentences.",
    "Write a short story for kids that involves {topic}.",
    "Give me five quiz questions about {topic}, with answers.",
    "How would you teach {topic} to a classroom of ten-year-olds?",
    "Write a tweet about {topic}.",
]

CODING_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "counts the vowels in a sentence",
    "finds the largest element of a list",
    "removes duplicates from a list",
    "checks whether a word is a palindrome",
    "sorts a list with bubble sort",
    "merges two sorted lists",
    "converts Celsius to Fahrenheit",
    "sums the digits of an integer",
    "counts word frequencies in a text",
    "flattens a nested list",
    "computes the greatest common divisor",
    "checks whether two strings are anagrams",
]

CODING_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a JavaScript function that {task}, with a short explanation.",
    "Explain step by step how to write a function that {task}.",
    "Write a Python function that {task}, and add a docstring and two tests.",
]


def all_prompts(seed: int = 0) -> list[str]:
    """Every template x topic combination (544 prompts), in a fixed shuffled order."""
    prompts = [t.format(topic=topic) for t, topic in itertools.product(GENERAL_TEMPLATES, TOPICS)]
    prompts += [t.format(task=task) for t, task in itertools.product(CODING_TEMPLATES, CODING_TASKS)]
    # Shuffled so that any prefix of the list mixes templates and topics.
    random.Random(seed).shuffle(prompts)
    return prompts


def split_prompts(num_train: int, num_heldout: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out) prompts, disjoint. The held-out set is taken first, from the end
    of the shuffled list, so it does not change when num_train does."""
    prompts = all_prompts(seed)
    if num_train < 0 or num_heldout < 0 or num_train + num_heldout > len(prompts):
        raise ValueError(
            f"num_train ({num_train}) + num_heldout ({num_heldout}) must be within the "
            f"{len(prompts)} prompts of the set"
        )
    heldout = prompts[len(prompts) - num_heldout :]
    return prompts[:num_train], heldout


def validation_prompts(num_train: int, num_validation: int, num_heldout: int, seed: int = 0) -> list[str]:
    """The prompts between split_prompts' training and held-out parts: for choosing among a
    training run's checkpoints, so that the held-out set stays unseen by every choice."""
    prompts = all_prompts(seed)
    if min(num_train, num_validation, num_heldout) < 0 or num_train + num_validation + num_heldout > len(prompts):
        raise ValueError(
            f"num_train ({num_train}) + num_validation ({num_validation}) + num_heldout ({num_heldout}) must be "
            f"within the {len(prompts)} prompts of the set"
        )
    return prompts[num_train : num_train + num_validation]
