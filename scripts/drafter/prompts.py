"""Training prompts for the distilled drafter: chat requests of the kinds a user types.

The drafter learns to predict the target's replies, so it trains on replies to
requests like the chat benchmark's (explanations, code, lists, letters, summaries,
rewrites, stories, how-tos, comparisons), made here from topic x task templates.
None of them is a benchmark prompt (scripts/benchmarks/chat_prompts.py): the
benchmark measures the drafter on requests it never saw, and `training_prompts`
refuses to return one.
"""

from __future__ import annotations

import random

TOPICS = (
    "photosynthesis", "volcanoes", "the water cycle", "black holes", "vaccines", "the stock market",
    "inflation", "electric cars", "solar panels", "the internet", "encryption", "machine learning",
    "the Roman Empire", "the printing press", "the French Revolution", "earthquakes", "tides",
    "rainbows", "the human heart", "sleep", "coffee", "bread baking", "composting", "honeybees",
    "climate change", "recycling", "the moon landing", "gravity", "magnets", "batteries",
    "airplanes", "bicycles", "trains", "the immune system", "DNA", "evolution", "dinosaurs",
    "the ocean", "rain forests", "deserts", "music theory", "chess", "meditation", "running",
    "budgeting", "credit cards", "job interviews", "public speaking", "learning a language",
    "time management", "gardening", "houseplants", "dogs", "cats", "birds", "the Olympics",
    "democracy", "taxes", "renewable energy", "nuclear power", "microwaves", "GPS", "smartphones",
    "cloud computing", "databases", "operating systems", "compilers", "version control",
    "web browsers", "email", "password security", "3D printing", "robots", "the brain",
    "memory", "nutrition", "vitamins", "exercise", "first aid", "camping", "photography",
)

CODE_TASKS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts how often each word appears in a text.",
    "Write a Python class for a simple stack with push, pop and peek.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that reads a CSV file and returns the sum of one column.",
    "Write a JavaScript function that debounces another function.",
    "Write a JavaScript function that capitalizes the first letter of every word.",
    "Write a SQL query that counts the orders per customer from a table orders(id, customer_id).",
    "Write a SQL query that finds the average salary per department.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that finds the largest element of a list without using max().",
    "Write a Python function that performs binary search on a sorted list.",
    "Write a bash command that finds every .log file larger than 10 MB.",
    "Write a Python function that converts Celsius to Fahrenheit, with a docstring.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a C function that reverses a string in place.",
    "Write a Python function that returns the factorial of a number, recursively.",
    "Write a Python script that prints the numbers 1 to 100, Fizz for multiples of 3 and Buzz for 5.",
    "Write a Python function that sorts a list of dictionaries by one key.",
    "Write a Python function that computes the mean and median of a list of numbers.",
    "Explain what a Python list comprehension is, with an example.",
    "Explain the difference between a list and a tuple in Python.",
    "Explain what recursion is, with a short code example.",
)

TOPIC_TASKS = (
    "Explain {t} in simple terms.",
    "Explain how {t} works to a ten-year-old.",
    "What are the main facts everyone should know about {t}?",
    "List five interesting facts about {t}.",
    "Give me six tips related to {t}, one line each.",
    "Write a short paragraph about the history of {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Write a short blog post introduction about {t}.",
    "Summarize what {t} is in three sentences.",
    "What are common misconceptions about {t}?",
    "Write three quiz questions about {t}, with answers.",
)

WRITING_TASKS = (
    "Write a short email to my manager asking for a day off next Friday.",
    "Write a thank-you note to a friend who helped me move.",
    "Write a polite complaint to a hotel about a noisy room.",
    "Write a cover letter opening for a junior software developer job.",
    "Write a short letter to a neighbor about a shared fence that needs repair.",
    "Write a message inviting my team to a lunch on Thursday.",
    "Write a short apology email for missing a meeting.",
    "Write a product description for a reusable water bottle.",
    "Write a short speech for a friend's birthday party.",
    "Write the opening paragraph of a story about a robot who learns to paint.",
    "Write the opening paragraph of a mystery story set on a train.",
    "Write a short fable about a fox and a crow.",
    "Write a haiku about autumn leaves.",
    "Give me a recipe for pancakes, with the steps.",
    "How do I change a flat tire on a bicycle? Give the steps.",
    "How do I boil an egg perfectly? Give the steps.",
    "How do I start running if I have never exercised? Give a plan.",
    "Give me a shopping list for a week of healthy meals.",
    "Give me a daily schedule for studying for an exam.",
    "Plan a one-day trip to a big city for a family with children.",
    "What should I pack for a beach holiday?",
    "What is the difference between weather and climate?",
    "What is the difference between a crocodile and an alligator?",
    "What is the difference between RAM and storage in a computer?",
    "What is the difference between a noun and a verb?",
)

REWRITES = (
    "i cant come to the party tomorrow sorry something came up",
    "the meeting got moved to 3pm pls tell everyone asap",
    "we need more people on the project or it wont be done in time",
    "ur order is late because the warehouse had problems, we r sorry",
    "can someone fix the printer its broken again",
    "the results look good but we should test more before we ship",
)

PASSAGES = (
    "The library will close for renovations from June to August. During this time, books can be "
    "returned at the community center, and the online catalog will remain available. The new "
    "library will have a larger children's section, a quiet study room and a cafe.",
    "A new study found that people who walk for thirty minutes a day sleep better and report less "
    "stress. The researchers followed two thousand adults for a year. They say even short walks "
    "help, but that regular habits matter more than long walks once a week.",
    "The company announced that it will open a second factory next year, creating about five "
    "hundred jobs. The factory will build batteries for electric buses. Local leaders welcomed the "
    "news, though some residents worry about traffic near the site.",
    "Heavy rain caused flooding in several villages over the weekend. Roads were closed and some "
    "families had to leave their homes. Volunteers handed out food and blankets, and officials "
    "said the water should go down within a few days.",
)


def training_prompts(count: int, seed: int = 0, exclude: tuple[str, ...] = ()) -> list[str]:
    """`count` distinct user messages, shuffled with `seed`, none of them in `exclude`."""
    pool = [task.format(t=topic) for topic in TOPICS for task in TOPIC_TASKS]
    pool += list(CODE_TASKS) + list(WRITING_TASKS)
    pool += [f'Rewrite this sentence to be more formal: "{s}"' for s in REWRITES]
    pool += [f"Summarize this paragraph in two sentences:\n\n{p}" for p in PASSAGES]
    pool += [f"Summarize this paragraph in one sentence:\n\n{p}" for p in PASSAGES]
    excluded = set(exclude)
    pool = sorted({p for p in pool if p not in excluded})
    if count > len(pool):
        raise ValueError(f"only {len(pool)} distinct training prompts, asked for {count}")
    random.Random(seed).shuffle(pool)
    return pool[:count]
