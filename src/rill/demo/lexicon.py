"""Word tables and agreement helpers for the demo corpus (``rill.demo.stories``).

Everything here is data plus small pure helpers: characters with their pronouns, things
with the right article, places with what one sees, does and loses there. The vocabulary is
kept to a few hundred common words on purpose: a model of a few million parameters trained
for minutes can only learn a small language well.
Imports only the standard library.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

GIRL_NAMES = (
    "Lily",
    "Mia",
    "Sue",
    "Anna",
    "Emma",
    "Lucy",
    "Sara",
    "Kim",
    "Zoe",
    "Amy",
    "Ella",
    "Jane",
    "Rosa",
    "Nina",
    "Ruby",
    "Molly",
    "Daisy",
    "Lena",
    "Ivy",
    "Maya",
    "Hannah",
    "Grace",
)
BOY_NAMES = (
    "Tom",
    "Max",
    "Ben",
    "Sam",
    "Leo",
    "Jack",
    "Tim",
    "Finn",
    "Noah",
    "Eli",
    "Jake",
    "Luke",
    "Oscar",
    "Pete",
    "Adam",
    "Hugo",
    "Milo",
    "Ryan",
    "Owen",
    "Dan",
    "Theo",
    "Kai",
)
PET_NAMES = (
    "Spot",
    "Fluffy",
    "Buddy",
    "Coco",
    "Pip",
    "Bubbles",
    "Sunny",
    "Patch",
    "Rex",
    "Bella",
    "Socks",
    "Pepper",
    "Ginger",
    "Rosie",
    "Biscuit",
    "Teddy",
)
# Animals that can be story heroes; each has its sound and the way it moves.
ANIMALS = {
    "cat": ("meow", "ran"),
    "dog": ("woof", "ran"),
    "bird": ("tweet", "flew"),
    "rabbit": ("squeak", "hopped"),
    "bear": ("growl", "walked"),
    "fox": ("yip", "ran"),
    "frog": ("ribbit", "hopped"),
    "mouse": ("squeak", "ran"),
    "duck": ("quack", "waddled"),
    "owl": ("hoot", "flew"),
    "pig": ("oink", "ran"),
    "cow": ("moo", "walked"),
    "lion": ("roar", "ran"),
    "turtle": ("hello", "crawled"),
    "puppy": ("woof", "ran"),
    "kitten": ("meow", "ran"),
    "squirrel": ("squeak", "ran"),
    "horse": ("neigh", "ran"),
    "sheep": ("baa", "walked"),
    "monkey": ("ooh ooh", "jumped"),
    "dragon": ("roar", "flew"),
    "bee": ("buzz", "flew"),
}
PEOPLE_KINDS = {"girl": "f", "boy": "m"}
HERO_ADJECTIVES = (
    "little",
    "small",
    "big",
    "happy",
    "kind",
    "brave",
    "shy",
    "curious",
    "silly",
    "friendly",
    "clever",
    "gentle",
    "young",
    "funny",
    "busy",
    "quiet",
    "sleepy",
    "playful",
)
COLORS = ("red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "black", "brown")
# Toys and objects a child may own, lose, share or find.
TOYS = (
    "ball",
    "kite",
    "doll",
    "teddy bear",
    "toy car",
    "toy boat",
    "hat",
    "drum",
    "book",
    "train",
    "robot",
    "box",
    "balloon",
    "shell",
    "crayon",
    "block",
    "bike",
    "blanket",
    "scarf",
    "ring",
    "stick",
    "truck",
    "puzzle",
    "jar",
    "bell",
    "spoon",
    "cup",
    "sock",
)
FOODS = (
    "apple",
    "cookie",
    "cake",
    "banana",
    "sandwich",
    "carrot",
    "pie",
    "orange",
    "muffin",
    "pear",
    "bun",
    "candy",
    "ice cream",
    "pizza",
    "soup",
    "egg",
)
FEELINGS_GOOD = ("happy", "glad", "excited", "proud", "calm", "thankful", "safe")
FEELINGS_BAD = ("sad", "scared", "angry", "worried", "lonely", "upset", "tired", "grumpy")
FEARS = (
    "the dark",
    "loud thunder",
    "the big slide",
    "deep water",
    "the tall tree",
    "the big dog",
    "the noisy truck",
    "the old house",
)
SKILLS = (
    ("ride a bike", "rode the bike"),
    ("swim", "swam in the water"),
    ("fly a kite", "flew the kite"),
    ("climb the tree", "climbed the tree"),
    ("jump rope", "jumped rope"),
    ("catch a ball", "caught the ball"),
    ("tie a shoe", "tied the shoe"),
    ("whistle", "whistled a song"),
    ("read a book", "read the book"),
    ("skate", "skated around"),
)
GAMES = (
    "tag",
    "hide and seek",
    "catch",
    "ball",
    "house",
    "a game of chase",
    "dress up",
    "pretend",
    "with blocks",
)
WEATHER_BAD = ("it started to rain", "a big storm came", "the wind blew hard", "it began to snow")
INDOOR_FUN = (
    "built a fort with blankets",
    "drew pictures",
    "baked cookies",
    "read a book",
    "played a board game",
    "made a puppet show",
    "sang songs",
    "did a puzzle",
)
GIFTS = (
    "drew a picture",
    "picked some flowers",
    "baked a cake",
    "made a card",
    "wrote a poem",
    "made a necklace",
    "built a little house",
)
SURPRISES = (
    "a tiny kitten",
    "a shiny coin",
    "an old map",
    "a golden key",
    "a little bird",
    "a box of crayons",
    "a red ball",
    "a sleepy puppy",
    "a pretty shell",
    "a secret note",
)
BREAKABLES = ("vase", "plate", "cup", "lamp", "bowl", "jar", "window")
ELDERS = {"mom": "f", "dad": "m", "grandma": "f", "grandpa": "m", "teacher": "f", "aunt": "f"}

# place -> (things one sees, things one does (past tense), where something gets lost)
PLACES = {
    "park": (
        ("tall trees", "a big slide", "ducks in the pond", "kids on the swings"),
        ("played on the swings", "ran on the grass", "went down the slide", "fed the ducks"),
        ("under a bench", "behind a big tree", "near the pond", "in the tall grass"),
    ),
    "forest": (
        ("big trees", "pretty flowers", "a small stream", "a squirrel"),
        ("walked on the path", "picked berries", "listened to the birds", "jumped over logs"),
        ("under a log", "behind a bush", "near a big rock", "under some leaves"),
    ),
    "beach": (
        ("blue waves", "white sand", "big shells", "a crab"),
        ("built a sand castle", "swam in the sea", "looked for shells", "ran on the sand"),
        ("under the sand", "near the water", "behind a rock", "under a towel"),
    ),
    "garden": (
        ("red flowers", "a big tree", "a little bee", "green leaves"),
        ("watered the plants", "picked flowers", "dug in the dirt", "chased butterflies"),
        ("under a bush", "in the flower bed", "behind the shed", "near the fence"),
    ),
    "farm": (
        ("a big red barn", "cows and pigs", "a tall tractor", "hens and eggs"),
        ("fed the pigs", "rode on the tractor", "picked apples", "played in the hay"),
        ("in the hay", "behind the barn", "near the fence", "under the tractor"),
    ),
    "zoo": (
        ("a tall giraffe", "a big lion", "funny monkeys", "a huge elephant"),
        ("looked at the lions", "fed the goats", "watched the monkeys", "ate ice cream"),
        ("near the gate", "under a bench", "by the lion cage", "behind a tree"),
    ),
    "lake": (
        ("calm water", "a little boat", "green frogs", "fish in the water"),
        ("threw stones in the water", "sat in a boat", "fed the ducks", "went fishing"),
        ("near the water", "under a rock", "in the mud", "behind a tree"),
    ),
    "school": (
        ("many desks", "a big board", "colorful books", "a fish tank"),
        ("read books", "painted pictures", "sang songs", "played at recess"),
        ("under a desk", "in the coat room", "behind the bookshelf", "near the door"),
    ),
    "house": (
        ("a cozy room", "a warm kitchen", "a soft bed", "a big window"),
        ("played with toys", "helped in the kitchen", "built a tower", "drew pictures"),
        ("under the bed", "behind the couch", "in the toy box", "under a pillow"),
    ),
    "playground": (
        ("a tall slide", "a sandbox", "swings", "a red seesaw"),
        ("went down the slide", "played in the sandbox", "swung high", "ran around"),
        ("in the sandbox", "under the slide", "near the swings", "behind the seesaw"),
    ),
    "hill": (
        ("green grass", "the whole town", "white clouds", "a big tree"),
        ("rolled down the grass", "flew a kite", "had a picnic", "looked at the clouds"),
        ("behind a rock", "in the grass", "under the big tree", "near the top"),
    ),
    "river": (
        ("fast water", "smooth stones", "a wooden bridge", "little fish"),
        ("threw stones", "walked on the bridge", "splashed in the water", "looked at the fish"),
        ("under the bridge", "near the water", "between the stones", "in the reeds"),
    ),
}
OUTDOOR_PLACES = tuple(place for place in PLACES if place not in ("house", "school"))
TOWN_WORDS = ("a small town", "a little village", "a big city", "a quiet forest", "a sunny land")
SPEECH_VERBS = ("said", "asked", "shouted", "whispered", "replied", "cried", "laughed", "smiled")
VOWELS = "aeiou"


def at(place: str) -> str:
    """Where one is in a place: "in the house", "at the park"."""
    return f"in the {place}" if place == "house" else f"at the {place}"


def a(word: str) -> str:
    """Return ``word`` with the right indefinite article ("a ball", "an apple")."""
    return ("an " if word[0] in VOWELS else "a ") + word


@dataclass(frozen=True)
class Character:
    """Someone in a story, with how the narrator names them and their pronouns.

    ``ref`` is the short name used after the introduction ("Lily", "the cat", "her mom"),
    ``intro`` the first mention ("a little girl named Lily"), ``address`` what others call
    them in dialogue ("Lily", "Mom"), ``gender`` one of ``f``, ``m``, ``n``.
    """

    ref: str
    intro: str
    address: str
    gender: str
    kind: str
    name: str | None = None

    @property
    def he(self) -> str:
        """Subject pronoun."""
        return {"f": "she", "m": "he", "n": "it"}[self.gender]

    @property
    def him(self) -> str:
        """Object pronoun."""
        return {"f": "her", "m": "him", "n": "it"}[self.gender]

    @property
    def his(self) -> str:
        """Possessive determiner."""
        return {"f": "her", "m": "his", "n": "its"}[self.gender]

    @property
    def himself(self) -> str:
        """Reflexive pronoun."""
        return {"f": "herself", "m": "himself", "n": "itself"}[self.gender]


def make_hero(rng: random.Random, kind: str | None = None, name: str | None = None) -> Character:
    """Pick a story hero: a named child, a named animal, or (sometimes) an unnamed animal."""
    if kind is None:
        kind = rng.choice(("girl", "boy", "girl", "boy", *ANIMALS))
    adjective = rng.choice(HERO_ADJECTIVES)
    if kind in PEOPLE_KINDS:
        gender = PEOPLE_KINDS[kind]
        name = name or rng.choice(GIRL_NAMES if gender == "f" else BOY_NAMES)
        return Character(name, f"{a(adjective)} {kind} named {name}", name, gender, kind, name)
    if name is None and rng.random() < 0.25:
        # Unnamed animals are "it": this keeps agreement simple and teaches the pronoun.
        return Character(f"the {kind}", f"{a(adjective)} {kind}", f"little {kind}", "n", kind)
    gender = rng.choice("fm")
    name = name or rng.choice(PET_NAMES)
    return Character(name, f"{a(adjective)} {kind} named {name}", name, gender, kind, name)


def make_friend(rng: random.Random, hero: Character) -> Character:
    """Pick a second character whose name and kind differ from the hero's."""
    while True:
        friend = make_hero(rng, kind=hero.kind if rng.random() < 0.5 else None)
        if friend.ref != hero.ref:
            return friend


def make_elder(rng: random.Random, child: Character, kind: str | None = None) -> Character:
    """A parent or grown-up of ``child``: "her mom" in narration, "Mom" in dialogue."""
    if kind is None:
        kinds = ("mom", "dad") if child.kind in ANIMALS else tuple(ELDERS) + ("mom", "dad")
        kind = rng.choice(kinds)
    ref = f"{child.his} {kind}"
    return Character(ref, ref, kind.capitalize(), ELDERS[kind], kind)


def make_thing(rng: random.Random, noun: str | None = None) -> str:
    """A toy noun phrase without article, sometimes with a color: "red ball"."""
    noun = noun or rng.choice(TOYS)
    if rng.random() < 0.5:
        return f"{rng.choice(COLORS)} {noun}"
    return noun
