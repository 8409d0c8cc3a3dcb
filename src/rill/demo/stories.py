"""Procedural short stories in simple English, in the spirit of TinyStories.

A story is an opening, one of a dozen plots (a lost toy, sharing, a new friend, being
brave, a rainy day, helping, a gift, a trip, a mistake, learning a skill, a surprise, a race)
and an ending. Each plot picks among several wordings of every sentence, so the same plot
rarely reads the same twice. All text comes from this code and ``rill.demo.lexicon``:
the corpus is the project's own, under the project's license.
Imports only the standard library.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import rill.demo.lexicon as lx
from rill.demo.lexicon import Character, a

QUESTION_VERBS = ("asked",)
TELL_VERBS = ("said", "said", "said", "shouted", "whispered")
REPLY_VERBS = ("said", "said", "replied", "replied")


def cap(text: str) -> str:
    """Capitalize the first letter only ("her mom" -> "Her mom")."""
    return text[:1].upper() + text[1:]


class Story:
    """Collects sentences into paragraphs, picking one wording from each set of options."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.paragraphs: list[list[str]] = [[]]

    def add(self, *options: str) -> None:
        """Append one of ``options`` as a sentence (capitalized)."""
        self.paragraphs[-1].append(cap(self.rng.choice(options)))

    def say(self, who: Character, line: str, verb: str | None = None, *, reply: bool = False) -> None:
        """Append a line of dialogue in one of three shapes, with the right punctuation.

        ``verb`` fixes the speech verb; otherwise it fits the line (a question is "asked",
        an answer to one, ``reply``, may be "replied").
        """
        if verb is None:
            verbs = QUESTION_VERBS if line.endswith("?") else REPLY_VERBS if reply else TELL_VERBS
            verb = self.rng.choice(verbs)
        shape = self.rng.random()
        if shape < 0.35:
            self.add(f'{who.ref} {verb}, "{line}"')
            return
        # Quote first: a final period turns into a comma before the speech verb.
        quoted = line[:-1] + "," if line.endswith(".") else line
        if shape < 0.7 or who.ref.startswith(("his ", "her ", "its ")):
            self.add(f'"{quoted}" {who.ref} {verb}.')
        else:
            self.add(f'"{quoted}" {verb} {who.ref}.')

    def para(self) -> None:
        """Start a new paragraph."""
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def text(self) -> str:
        """The story so far, paragraphs separated by a blank line."""
        return "\n\n".join(" ".join(p) for p in self.paragraphs if p)


def open_story(s: Story, hero: Character) -> None:
    """First sentence: introduce the hero."""
    town = s.rng.choice(lx.TOWN_WORDS)
    s.add(
        f"Once upon a time, there was {hero.intro}.",
        f"Once upon a time, there was {hero.intro}.",
        f"Once upon a time, in {town}, there lived {hero.intro}.",
        f"There once was {hero.intro}.",
        f"Once there was {hero.intro} who lived in {town}.",
    )


def close_story(s: Story, moral: tuple[str, ...]) -> None:
    """A moral (sometimes) and "The end." (usually)."""
    if s.rng.random() < 0.6:
        s.add(*moral)
    if s.rng.random() < 0.85:
        s.add("The end.")


def plot_lost(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero loses a toy and a helper finds it with them."""
    rng, (_, acts, spots) = s.rng, lx.PLACES[place]
    helper = lx.make_elder(rng, hero) if rng.random() < 0.5 else lx.make_friend(rng, hero)
    s.add(f"{hero.ref} had {a(thing)}.", f"{hero.his} favorite toy was {a(thing)}.")
    s.add(f"{hero.he} took it everywhere.", f"{hero.he} loved it very much.")
    s.para()
    s.add(f"One day, {hero.ref} went to the {place} with {hero.his} {thing}.")
    s.add(f"{hero.he} {rng.choice(acts)}.", f"{hero.he} {rng.choice(acts)} and had lots of fun.")
    s.add(f"When it was time to go home, {hero.ref} looked for {hero.his} {thing}, but it was gone!")
    s.add(f"{hero.ref} felt very sad.", f"{hero.ref} started to cry.")
    s.say(hero, f"Where is my {thing}?", s.rng.choice(("asked", "cried")))
    s.para()
    s.add(f"{helper.intro} saw that {hero.ref} was sad.", f"{helper.intro} came to help.")
    s.say(helper, rng.choice(("Don't be sad. I will help you look for it.", "Let's look for it together.")))
    first, second = rng.sample(spots, 2)
    s.add(f"They looked {first}, but it was not there.")
    s.add(f"Then they looked {second}.")
    s.add(f"There was the {thing}!", f"The {thing} was there!")
    s.para()
    s.say(hero, f"Thank you, {helper.address}!")
    s.add(f"{hero.ref} gave {helper.ref} a big hug.", f"{hero.ref} was so happy.")
    close_story(
        s,
        (
            f"From that day on, {hero.ref} always kept {hero.his} {thing} close.",
            "Friends help each other when things go wrong.",
        ),
    )


def plot_share(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero will not share, feels lonely, then shares."""
    friend = lx.make_friend(s.rng, hero)
    s.add(f"{hero.ref} had a new {thing}.", f"{hero.ref} got a new {thing} for {hero.his} birthday.")
    s.add(f"{hero.he} loved to play with it every day.")
    s.para()
    s.add(f"One day, {hero.ref} was playing with {hero.his} {thing} {lx.at(place)}.")
    s.add(f"{friend.intro} came over.", f"{friend.intro} saw the {thing}.")
    s.say(friend, s.rng.choice((f"Can I play with your {thing}?", "Can I play too?")))
    s.add(f"{hero.ref} did not want to share.")
    s.say(hero, f"No, it is my {thing}!")
    s.add(f"{friend.ref} felt sad and walked away.")
    s.para()
    s.add(f"{hero.ref} played alone, but it was not fun.", f"Soon {hero.ref} felt lonely.")
    s.add(f"{hero.he} thought about {friend.ref}.")
    s.add(f"Then {hero.he} ran to {friend.ref}.")
    s.say(hero, f"I am sorry. Do you want to play with my {thing}?")
    s.say(friend, s.rng.choice(("Yes! Thank you!", "Yes, I would love to!")), reply=True)
    s.add("They played together all day and laughed a lot.", "They had so much fun together.")
    close_story(s, (f"{hero.ref} learned that sharing is fun.", "Sharing made them both happy."))


def plot_friend(s: Story, hero: Character, place: str, thing: str) -> None:
    """A lonely hero meets someone and they become friends."""
    rng, (_, _, spots) = s.rng, lx.PLACES[place]
    friend, game = lx.make_friend(rng, hero), rng.choice(lx.GAMES)
    s.add(f"{hero.ref} lived near the {place}.", f"{hero.ref} liked to go to the {place}.")
    s.add(f"{hero.he} did not have any friends, so {hero.he} often felt lonely.")
    s.para()
    s.add(f"One day, {hero.ref} saw {friend.intro} sitting alone {rng.choice(spots)}.")
    s.add(f"{friend.ref} looked sad too.")
    if hero.name:
        s.say(hero, f"Hi! My name is {hero.name}. What is your name?")
        s.say(friend, f"I am {friend.name}." if friend.name else "I do not have a name.", reply=True)
    else:
        s.say(hero, "Hello! Do you want to be my friend?")
        s.say(friend, "Yes, I would like that.", reply=True)
    s.say(hero, f"Do you want to play {game}?")
    s.say(friend, rng.choice(("Yes, I would love to!", "Okay, let's play!")), reply=True)
    s.para()
    s.add(f"They played {game} all afternoon.")
    s.add(f"{hero.ref} and {friend.ref} became best friends.")
    close_story(s, ("They were never lonely again.", "A new friend can make any day better."))


def plot_brave(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero is afraid, a grown-up helps, the hero is brave."""
    elder, fear = lx.make_elder(s.rng, hero), s.rng.choice(lx.FEARS)
    s.add(f"{hero.ref} was scared of {fear}.", f"{hero.ref} was afraid of {fear}.")
    s.add(f"When {hero.he} thought about {fear}, {hero.his} heart beat fast.")
    s.para()
    s.add(f"One day, {hero.ref} told {elder.ref} about it.")
    s.say(hero, f"I am scared of {fear}.")
    s.say(elder, f"You are brave, {hero.address}. Let's try together.", reply=True)
    s.add(f"{hero.ref} held {elder.ref}'s hand and took a deep breath.")
    s.add("It was not so bad!", "It was not scary at all!")
    s.para()
    s.say(hero, "I did it! I am not scared anymore!", "shouted")
    s.add(f"{elder.ref} was very proud of {hero.him}.")
    close_story(
        s,
        (
            f"{hero.ref} learned that being brave is not easy, but it is good.",
            "Sometimes the things we fear are not so bad.",
        ),
    )


def plot_rain(s: Story, hero: Character, place: str, thing: str) -> None:
    """Bad weather spoils the plan; fun inside; a rainbow."""
    rng, elder = s.rng, lx.make_elder(s.rng, hero)
    s.add(f"{hero.ref} wanted to play at the {place}.", f"{hero.ref} loved to play at the {place}.")
    s.add(f"But then {rng.choice(lx.WEATHER_BAD)}.")
    s.add(f"{hero.ref} was sad.", f"{hero.ref} felt grumpy.")
    s.say(hero, "Now I can't go outside!")
    s.para()
    s.say(elder, rng.choice(("Don't worry. We can have fun inside.", "Let's play inside today.")))
    s.add(f"So they {rng.choice(lx.INDOOR_FUN)}.")
    s.add(f"Then they {rng.choice(lx.INDOOR_FUN)}.")
    s.add(f"{hero.ref} had so much fun.")
    s.para()
    s.add("Later, the sun came out and there was a big rainbow in the sky.")
    s.say(hero, "Look! A rainbow!", "shouted")
    close_story(s, ("It was the best day ever.", "Even a rainy day can be a happy day."))


PROBLEMS = (
    ("was stuck in a tree", "climbed up and helped {him} get down"),
    ("had a hurt leg", "helped {him} walk home slowly"),
    ("could not find {his} way home", "showed {him} the way home"),
    ("was very hungry", "shared {own} food with {him}"),
    ("was cold and wet", "gave {him} a warm blanket"),
)


def plot_help(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero helps someone in trouble."""
    other = lx.make_friend(s.rng, hero)
    trouble, fix = s.rng.choice(PROBLEMS)
    s.add(f"One day, {hero.ref} was walking in the {place}.")
    s.add(f"{hero.he} heard a small voice.", "Suddenly, there was a little cry.")
    s.add(f"It was {other.intro}.")
    s.add(f"{other.he} {trouble.format(his=other.his)}.")
    s.say(other, "Help! Please help me!", "cried")
    s.para()
    s.add(f"{hero.ref} {fix.format(him=other.him, own=hero.his)}.")
    s.say(other, "Thank you! You are very kind.")
    s.add(f"{hero.ref} felt warm and happy inside.")
    close_story(s, ("Helping others is a good thing to do.", "A little kindness goes a long way."))


def plot_gift(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero makes a birthday gift for a grown-up."""
    elder, gift = lx.make_elder(s.rng, hero), s.rng.choice(lx.GIFTS)
    s.add(f"Tomorrow was {elder.ref}'s birthday.")
    s.add(f"{hero.ref} wanted to give {elder.him} something special.")
    s.add(f"But {hero.he} did not have any money.", f"But {hero.he} did not know what to give.")
    s.add(f"Then {hero.he} had an idea.")
    s.add(f"{hero.he} {gift}.")
    s.add(f"It took a long time, but {hero.he} did not give up.")
    s.para()
    s.add(f"The next day, {hero.ref} gave the gift to {elder.ref}.")
    s.say(hero, f"Happy birthday, {elder.address}!", "shouted")
    s.add(f"{elder.ref} smiled a big smile.")
    s.say(elder, s.rng.choice(("Thank you! It is the best gift ever.", "I love it! Thank you so much.")))
    s.add(f"They hugged, and {hero.ref} felt very proud.")
    close_story(s, ("A gift made with love is the best gift.", "Giving can be as fun as getting."))


def plot_trip(s: Story, hero: Character, place: str, thing: str) -> None:
    """A day out with a grown-up."""
    rng, (sights, acts, _) = s.rng, lx.PLACES[place]
    elder = lx.make_elder(rng, hero)
    sight1, sight2 = rng.sample(sights, 2)
    act1, act2 = rng.sample(acts, 2)
    s.add(f"One sunny morning, {hero.ref} and {elder.ref} went to the {place}.")
    s.add(f"{hero.ref} was so excited.")
    s.add(f"At the {place}, {hero.he} saw {sight1} and {sight2}.")
    s.add(f"First, they {act1}. Then they {act2}.")
    s.say(hero, f"I love the {place}!")
    s.para()
    s.add(f"{hero.ref} also found {rng.choice(lx.SURPRISES)}.")
    s.add("When the sun went down, they went home.")
    s.add(f"{hero.ref} was tired but happy.")
    close_story(s, (f"That night, {hero.he} dreamed about the {place}.", f"It was a day {hero.he} would never forget."))


def plot_mistake(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero breaks something and tells the truth."""
    elder, broken = lx.make_elder(s.rng, hero), s.rng.choice(lx.BREAKABLES)
    s.add(f"{hero.ref} was playing with {hero.his} {thing} in the house.")
    s.say(elder, "Please do not play with that inside.")
    s.add(f"But {hero.ref} did not listen.")
    s.add(f"{hero.he} threw the {thing} up high.")
    s.add(f"Crash! It hit the {broken}, and the {broken} broke.")
    s.para()
    s.add(f"{hero.ref} felt very bad.")
    s.add(f"{hero.he} wanted to hide, but {hero.he} knew that was wrong.")
    s.add(f"{hero.he} went to {elder.ref} and told {elder.him} the truth.")
    s.say(hero, f"I am sorry, {elder.address}. I broke the {broken}.")
    s.say(elder, "Thank you for telling me the truth. Next time, please play outside.", reply=True)
    s.add(f"{hero.ref} nodded and gave {elder.him} a hug.")
    close_story(s, (f"{hero.ref} learned to always tell the truth.", "Telling the truth is always best."))


def plot_learn(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero fails, tries again, and learns a skill."""
    elder, (skill, done) = lx.make_elder(s.rng, hero), s.rng.choice(lx.SKILLS)
    s.add(f"{hero.ref} wanted to learn to {skill}.")
    s.add(f"{hero.he} tried, but it was hard.", f"{hero.he} tried, but {hero.he} fell down.")
    s.say(hero, "This is too hard!")
    s.say(elder, "Keep trying. You can do it!")
    s.para()
    s.add(f"So {hero.ref} tried again and again.")
    s.add(f"At last, {hero.he} {done}!")
    s.say(hero, "I did it!", "shouted")
    s.add(f"{hero.ref} was so proud of {hero.himself}.")
    close_story(s, ("If you keep trying, you can do hard things.", "Practice makes things easy."))


def plot_surprise(s: Story, hero: Character, place: str, thing: str) -> None:
    """The hero finds a box with a surprise inside."""
    rng, (_, _, spots) = s.rng, lx.PLACES[place]
    elder = lx.make_elder(rng, hero)
    s.add(f"One day, {hero.ref} was playing {lx.at(place)}.")
    s.add(f"{hero.he} found a little box {rng.choice(spots)}.")
    s.add(f"{hero.ref} was very curious.")
    s.say(hero, "What is inside?", s.rng.choice(("asked", "wondered")))
    s.add(f"{hero.he} opened the box slowly.")
    s.add(f"Inside, there was {rng.choice(lx.SURPRISES)}!")
    s.para()
    s.add(f"{hero.he} ran to show {elder.ref}.")
    s.say(elder, "What a nice surprise!")
    s.add(f"{hero.ref} smiled all day long.")
    close_story(s, ("Sometimes the best things are hiding in small places.", "It was a happy day."))


def plot_race(s: Story, hero: Character, place: str, thing: str) -> None:
    """A race where stopping to help matters more than winning."""
    friend = lx.make_friend(s.rng, hero)
    s.add(f"{hero.ref} had a friend, {friend.intro}.")
    s.add("They liked to race.")
    s.say(hero, f"Let's race to the end of the {place}!")
    s.add("Ready, set, go! They ran as fast as they could.")
    s.add(f"But {friend.ref} tripped on a rock and fell down.")
    s.para()
    s.add(f"{hero.ref} stopped running and went back to help {friend.him}.")
    s.say(hero, "Are you okay?")
    s.say(friend, "Yes, thank you.", reply=True)
    s.add(f"They walked to the end of the {place} together.")
    close_story(s, ("Winning is fun, but friends are more important.", "They both felt like winners."))


Plot = Callable[[Story, Character, str, str], None]
PLOTS: dict[str, Plot] = {
    "lost": plot_lost,
    "sharing": plot_share,
    "friendship": plot_friend,
    "brave": plot_brave,
    "rain": plot_rain,
    "helping": plot_help,
    "birthday": plot_gift,
    "trip": plot_trip,
    "truth": plot_mistake,
    "trying": plot_learn,
    "surprise": plot_surprise,
    "race": plot_race,
}
THING_PLOTS = ("lost", "sharing", "truth")  # plots in which the toy matters
INDOOR_PLOTS = ("sharing", "surprise", "truth")  # plots that read well in any place


def story(
    rng: random.Random,
    *,
    kind: str | None = None,
    name: str | None = None,
    place: str | None = None,
    thing: str | None = None,
    plot: str | None = None,
) -> str:
    """Write one story; any of hero ``kind``/``name``, ``place``, ``thing`` or ``plot`` may be fixed."""
    if name is not None and kind is None:
        kind = "girl" if name in lx.GIRL_NAMES else "boy" if name in lx.BOY_NAMES else None
    hero = lx.make_hero(rng, kind=kind, name=name)
    plot = plot or rng.choice(THING_PLOTS if thing else tuple(PLOTS))
    if place is None:
        place = rng.choice(tuple(lx.PLACES) if plot in INDOOR_PLOTS else lx.OUTDOOR_PLACES)
    s = Story(rng)
    open_story(s, hero)
    PLOTS[plot](s, hero, place, lx.make_thing(rng, thing))
    return s.text()
