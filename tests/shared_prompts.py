"""Fixed prompts shared by the model tests (imported by name: conftest modules collide)."""

PROMPTS = [
    "What is 12 times 7? Explain briefly.",
    "Write a Python function that returns the factorial of n.",
    "Name three colors of the rainbow.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Translate 'good morning' into French and Spanish.",
]
