"""The small task families the built-in model is trained and evaluated on.

Each family yields chat exchanges ``(question, answer)`` with varied natural phrasings and a
short, exact answer: the bare result, no sentence around it (``"42"``, ``"tenalp"``,
``"apple, fig, pear"``), so evaluation is exact match on the stripped reply.
``generate(family, n, seed)`` is deterministic: the same arguments give the same list on every
machine and Python version (``random.Random`` seeded with a string is hash-seed independent).
The training corpus (``scripts/train_builtin.py``) and the evaluation (``dllm eval``) draw from
the same generator with different seeds. Training questions are composed (lead-in, frame,
operand phrasing, closing, casing and punctuation noise; words sometimes Capitalised or in
CAPITALS, so sorting ignores case and counting a letter counts it in either case).
``held_out=True`` asks in other words: templates training never produces (by ``skeleton``),
designed ones and natural ones written without seeing the training phrasings -- how the model
copes with phrasings it was not trained on.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

TRAIN_SEED = 0
EVAL_SEED = 20250611  # never used for training

# A few hundred common English words, lowercase, 3-8 letters (sorting uses those of 3-6).
WORDS: tuple[str, ...] = tuple(
    """
    able acid aged also area army away baby back ball band bank base bath bear beat bell belt
    best bird blow blue boat body bone book born boss both bowl bread brick bridge bright brown
    build burn busy cake call calm camp card care cart case cash cast cat chain chair chalk
    cheap check chess chief child city claim class clean clear clock cloud coach coast coat
    code cold color cook cool copy corn cost cotton cover crab cream crowd crown cup cycle
    dance dark date dawn deal deep desk dial diet dirt dish dog door dose dream dress drink
    drive drop drum duck dust eagle early earth east easy edge egg eight empty enemy enjoy
    equal event exam extra face fact fair farm fast father field fifty film find fine fire
    fish five flag flat floor flour flow flower fog fold food foot force forest fork form fox
    frame fresh friend frog fruit full fun game garden gate gift girl glad glass glove goal
    goat gold good grape grass great green grey group guard guest guide hair half hall hand
    happy hard harm hat head heart heat heavy help hero high hill home honey hope horse hotel
    hour house human ice idea inch iron island jacket jam job join joke juice jump key kid king
    kite knee knife lake lamp land large last late laugh lawn leaf left lemon letter level
    life light lime line lion list live lock long loud love lucky lunch magic mail main map
    march mark market mask meal meat melon metal milk mind mint model money month moon motor
    mouse mouth music nail name nest never night noise north nose note ocean offer oil old
    olive onion open orange order owl page paint pair paper park party pasta path peace peach
    pear pen pencil pepper piano pilot pink pipe plan planet plant plate plum pocket point
    pond pool potato power price print prize pump queen quick quiet rabbit radio rain river
    road robot rock roof room root rope rose round ruler salad salt sand scale school sea seed
    shape sheep shell ship shirt shoe shop short silver simple singer sister skirt sky sleep
    slow small smile snake snow soap sock soft song soup south space spoon spring square stamp
    star steam stone storm story street sugar summer sun swan sweet table tail taxi tea team
    tent tiger time toast today tomato tooth towel tower town toy train tree truck tulip
    turtle uncle union upper valley van vase violin voice wall warm watch water wave wheel
    whale white wind window wine winter wolf wood word world yard yellow young zebra zero zoo
    apple banana fig kiwi mango cherry
    animal balloon blanket bicycle cabbage captain chicken diamond dolphin elephant evening
    example feather holiday husband kitchen ladder library machine monkey morning mountain
    network officer orchard package pattern picture pumpkin rainbow sandwich science sunset
    teacher thunder umbrella unicorn village weather whisper yogurt
    """.split()
)
SHORT_WORDS: tuple[str, ...] = tuple(w for w in WORDS if len(w) <= 6)

Exchange = tuple[str, str]


def _number(rng: random.Random) -> int:
    """0-999, with 1-, 2- and 3-digit numbers equally likely."""
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


# ---------------------------------------------------------------------------------------------
# Phrasings. Training questions are composed: a courtesy lead-in (sometimes), a core template
# (a frame crossed with the ways of naming its operands), a closing word (sometimes), then
# surface noise (lowercase, no final mark). The held-out templates (further below) are whole
# questions that training never produces: every composed question whose skeleton -- lowercase,
# punctuation and courtesy words dropped -- equals a held-out template's skeleton is drawn again.
# ---------------------------------------------------------------------------------------------

LEAD_INS = (
    "Hey, ", "Hi, ", "Hello, ", "Hi! ", "Hey there, ", "Quick question: ", "Question: ",
    "Quick one: ", "OK, ", "Okay, ", "So, ", "Please, ", "Hi there! ", "Help me out: ",
    "I have a question. ", "Can you help? ", "Hmm, ", "Tell me, ",
)
CLOSINGS = (" please", ", please", " please?", ". Thanks", ", thanks!", " thanks", " for me",
            " :)", "??", "!", " quickly")
# Dropped from both sides before comparing a question with the held-out templates.
COURTESY = frozenset("please kindly hey hi hello there thanks thank you ok okay so quick question "
                     "one tell me can help hmm i have a out".split())


def skeleton(template: str) -> str:
    """The words of ``template`` that carry its meaning: lowercase, placeholders kept, ``+``,
    ``-`` and ``{op}`` one word ``op``, ``=`` kept, "what's" is "what is", every other non-letter a space, courtesy
    words dropped."""
    text = re.sub(r"\{(\w+)\}", r" _\1_ ", template.lower()).replace("_op_", "+")
    text = re.sub(r"\bwhat'?s\b", "what is", text)
    text = re.sub(r"\s*([-+=])\s*", r" \1 ", text).replace("+", "op").replace(" - ", " op ")
    return " ".join(w for w in re.sub(r"[^a-z_=]+", " ", text).split() if w not in COURTESY)


def _expand(frames: tuple[str, ...], slots: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Every frame with each ``<NAME>`` replaced by every phrase of ``slots[NAME]``."""
    out: list[str] = []
    for frame in frames:
        todo = [frame]
        for name, phrases in slots.items():
            todo = [t.replace(f"<{name}>", p) for t in todo for p in phrases] if (
                f"<{name}>" in frame) else todo
        out += todo
    return tuple(dict.fromkeys(out))


def _capitalize_first(text: str) -> str:
    return text[0].upper() + text[1:] if text and text[0].islower() else text


def _compose(rng: random.Random, cores: tuple[str, ...], forbidden: frozenset[str]) -> str:
    """One training question template: lead-in, core, closing, surface noise; never one whose
    skeleton is a held-out template's."""
    while True:
        core = rng.choice(cores)
        text = core
        if rng.random() < 0.25:
            lead = rng.choice(LEAD_INS)
            text = lead + (core[0].lower() + core[1:] if rng.random() < 0.7 else core)
        if rng.random() < 0.12:
            text = text.rstrip(".?!") + rng.choice(CLOSINGS)
        r = rng.random()
        if r < 0.08:
            text = text.lower()
        elif r < 0.2:
            text = text[0].lower() + text[1:]
        if rng.random() < 0.15 and text[-1] in ".?!":
            text = text[:-1]
        if skeleton(text) not in forbidden:
            return text


def _held_out(rng: random.Random, templates: tuple[str, ...]) -> str:
    text = rng.choice(templates)
    if rng.random() < 0.15:
        text = text[0].lower() + text[1:]
    if rng.random() < 0.15 and text[-1] in ".?":
        text = text[:-1]
    return text


def _cased(rng: random.Random, word: str) -> str:
    """A word as people type it: mostly lowercase, sometimes Capitalised, rarely in CAPITALS
    (sorting then ignores case, and counting a letter counts it in either case)."""
    r = rng.random()
    return word.capitalize() if r < 0.2 else word.upper() if r < 0.28 else word


def _op(rng: random.Random, sign: str) -> str:
    return sign if rng.random() < 0.5 else f" {sign} "


# --- add -------------------------------------------------------------------------------------
_ASK = ("What is <E>?", "What's <E>?", "Whats <E>", "what is <E>", "Compute <E>.",
        "Calculate <E>.", "Work out <E>.", "Evaluate <E>.", "Find <E>.", "Tell me <E>.",
        "Give me <E>.", "Can you compute <E>?", "Could you calculate <E>?",
        "Can you tell me <E>?", "How much is <E>?", "What does <E> equal?",
        "What does <E> come to?", "<E> = ?", "<E> =", "<E>", "<E>?", "<E> is?",
        "<E> equals?", "<E> equals what?", "What do you get for <E>?", "I need <E>.",
        "Do you know <E>?", "What number is <E>?", "What is the value of <E>?",
        "Result of <E>?", "Solve <E>.", "What's the answer to <E>?", "Figure out <E>.")
ADD_PHRASES = _expand(_ASK, {"E": (
    "{a}{op}{b}", "{a} plus {b}", "the sum of {a} and {b}", "the total of {a} and {b}",
    "{a} added to {b}", "{a} and {b} added together", "{a} plus {b} together")}) + (
    "Add {a} and {b}.", "Add {a} to {b}.", "Add {a} plus {b}.", "Add up {a} and {b}.",
    "Sum {a} and {b}.", "Sum of {a} and {b}?", "Total of {a} and {b}?",
    "Can you add {a} and {b}?", "Could you add {a} to {b}?",
    "If you add {a} and {b}, what do you get?", "If I add {a} to {b}, what do I get?",
    "What do you get when you add {a} and {b}?", "What do {a} and {b} add up to?",
    "What do {a} and {b} make?", "What do {a} and {b} make together?",
    "{a} and {b} together make what?", "How much are {a} and {b} together?",
    "What is the result of {a}{op}{b}?", "What is {a} and {b} added together?",
    "Add these numbers: {a} and {b}", "Add these: {a}, {b}", "Plus {a} and {b}?",
    "What is {a} more than {b}?", "Increase {a} by {b}.", "{a} increased by {b} is?",
    "The sum: {a}{op}{b}", "Sum: {a}{op}{b}", "{a} plus {b} is what?")

# --- sub -------------------------------------------------------------------------------------
SUB_PHRASES = _expand(_ASK, {"E": (
    "{a}{op}{b}", "{a} minus {b}", "{a} take away {b}", "{a} less {b}",
    "the difference between {a} and {b}", "{b} subtracted from {a}", "{a} with {b} taken away",
    "{b} taken from {a}", "{a} minus {b} exactly")}) + (
    "Subtract {b} from {a}.", "Take {b} away from {a}.", "Take {b} from {a}.",
    "Deduct {b} from {a}.", "Remove {b} from {a}.", "Can you subtract {b} from {a}?",
    "Could you take {b} away from {a}?", "If you subtract {b} from {a}, what do you get?",
    "If I take {b} from {a}, what is left?", "What do you get when you take {b} from {a}?",
    "What is left when you take {b} away from {a}?", "How much is left when {b} is taken from {a}?",
    "What remains if you subtract {b} from {a}?", "{a} minus {b} is what?",
    "Decrease {a} by {b}.", "{a} decreased by {b} is?", "{a} reduced by {b}?",
    "What is {a} reduced by {b}?", "Subtract: {a}{op}{b}", "The difference: {a}{op}{b}",
    "Difference of {a} and {b}?", "What's {b} less than {a}?", "Minus {b} from {a}?",
    "Start with {a} and subtract {b}.", "From {a}, subtract {b}.", "From {a} take away {b}.")

# --- compare ---------------------------------------------------------------------------------
_WHICH = ("Which is <P>, {a} or {b}?", "Which is <P>: {a} or {b}?", "Which is <P> {a} or {b}",
          "Which number is <P>, {a} or {b}?", "Which one is <P>, {a} or {b}?",
          "Which of {a} and {b} is <P>?", "Which of these is <P>: {a} or {b}?",
          "{a} or {b}, which is <P>?", "{a} or {b}: which is <P>?", "{a} or {b} - which is <P>?",
          "Between {a} and {b}, which is <P>?", "Of {a} and {b}, which is <P>?",
          "Is {a} or {b} <P>?", "Which is <P>? {a} or {b}", "Which value is <P>, {a} or {b}?",
          "Out of {a} and {b}, which one is <P>?")
_THE = ("What is the <A> of {a} and {b}?", "Give the <A> of {a} and {b}.",
        "Give me the <A> of {a} and {b}.", "Tell me the <A> of {a} and {b}.",
        "The <A> of {a} and {b}?", "Find the <A> of {a} and {b}.",
        "Pick the <A> number: {a} or {b}", "Choose the <A> one: {a} or {b}",
        "Which is the <A> number, {a} or {b}?", "What's the <A> number, {a} or {b}?",
        "Name the <A> of {a} and {b}.", "Return the <A> of {a} and {b}.")
LARGER_PHRASES = _expand(_WHICH, {"P": ("larger", "bigger", "greater", "higher", "more",
                                        "the larger one", "the bigger number")}) + _expand(
    _THE, {"A": ("larger", "bigger", "greater", "higher", "largest", "biggest")}) + (
    "max({a}, {b})", "max({a},{b})", "max of {a} and {b}", "maximum of {a} and {b}",
    "What is the maximum of {a} and {b}?", "Which is the max, {a} or {b}?")
SMALLER_PHRASES = _expand(_WHICH, {"P": ("smaller", "less", "lower", "the smaller one",
                                         "the smaller number", "the lower number")}) + _expand(
    _THE, {"A": ("smaller", "lower", "lesser", "smallest", "lowest")}) + (
    "min({a}, {b})", "min({a},{b})", "min of {a} and {b}", "minimum of {a} and {b}",
    "What is the minimum of {a} and {b}?", "Which is the min, {a} or {b}?")

# --- reverse ---------------------------------------------------------------------------------
_W = ("{w}", "the word {w}", "'{w}'", '"{w}"', "the word '{w}'", 'the word "{w}"')
REVERSE_PHRASES = _expand((
    "Reverse <W>.", "Reverse <W>", "reverse <W>", "Spell <W> backwards.", "Spell <W> backward.",
    "Spell <W> in reverse.", "Write <W> backwards.", "Write <W> in reverse.",
    "Say <W> backwards.", "Give me <W> backwards.", "Give <W> in reverse.",
    "What is <W> backwards?", "What is <W> reversed?", "What is <W> spelled backwards?",
    "What's <W> backwards?", "How do you spell <W> backwards?", "How is <W> spelled backwards?",
    "Can you reverse <W>?", "Could you spell <W> backwards?", "Can you write <W> backwards?",
    "<W> backwards?", "<W> backwards", "<W> reversed", "<W> reversed?", "<W> in reverse?",
    "What does <W> look like backwards?", "Flip <W>.", "Flip <W> around.",
    "Reverse the letters of <W>.", "Reverse the letters in <W>.", "Mirror <W>.",
    "Turn <W> around.", "Read <W> backwards.", "What is the reverse of <W>?",
    "Give the reverse of <W>.", "Backwards, <W> is?", "If you reverse <W>, what do you get?",
    "What do you get when you spell <W> backwards?", "Spell the letters of <W> backwards.",
), {"W": _W}) + ("Reverse the word: {w}", "Reverse this word: {w}", "Reverse: {w}",
                 "backwards: {w}", "Spell backwards: {w}", "Word to reverse: {w}",
                 "Reverse this: {w}", "Write this backwards: {w}")

# --- sort ------------------------------------------------------------------------------------
_O_END = ("these words: {ws}", "the words {ws}", "{ws}", "this list: {ws}",
          "the following words: {ws}", "these: {ws}", "the list {ws}", "these words {ws}")
_O_MID = ("the words {ws}", "{ws}", "these words ({ws})", "the list {ws}", "these words, {ws},")
SORT_PHRASES = _expand((
    "Sort <OE>", "Sort <OE>.", "Alphabetize <OE>", "Alphabetise <OE>",
    "Put in alphabetical order: {ws}", "Sort alphabetically: {ws}", "Sort A-Z: {ws}",
    "Sort from A to Z: {ws}", "Alphabetical order: {ws}", "sort: {ws}", "Order alphabetically: {ws}",
    "Arrange alphabetically: {ws}", "Arrange in alphabetical order: {ws}",
    "List alphabetically: {ws}", "Can you sort <OE>?", "Could you alphabetize <OE>?",
    "Please sort <OE>", "Sort <OM> alphabetically.", "Sort <OM> in alphabetical order.",
    "Put <OM> in alphabetical order.", "Put <OM> in order.", "Put <OM> in ABC order.",
    "Arrange <OM> alphabetically.", "Arrange <OM> in alphabetical order.",
    "List <OM> in alphabetical order.", "List <OM> alphabetically.", "Order <OM> alphabetically.",
    "Order <OM> from A to Z.", "Rearrange <OM> alphabetically.",
    "Can you put <OM> in alphabetical order?", "Could you sort <OM> alphabetically?",
    "What is the alphabetical order of <OM>?", "<OM> in alphabetical order?",
    "<OM> sorted alphabetically?", "<OM> sorted", "How do <OM> go in alphabetical order?",
    "Write <OM> in alphabetical order.", "Sort these alphabetically: {ws}",
    "Alphabetically, how do <OM> go?", "What order do <OM> go in alphabetically?",
), {"OE": _O_END, "OM": _O_MID})

# --- count -----------------------------------------------------------------------------------
LENGTH_PHRASES = _expand((
    "How many letters are in <W>?", "How many letters does <W> have?", "How many letters in <W>?",
    "How many characters are in <W>?", "How many characters does <W> have?",
    "Count the letters in <W>.", "Count the letters of <W>.", "Count the characters in <W>.",
    "What is the length of <W>?", "How long is <W>?", "Length of <W>?",
    "Number of letters in <W>?", "What is the number of letters in <W>?",
    "How many letters has <W> got?", "Tell me the number of letters in <W>.",
    "Letter count of <W>?", "How many letters is <W>?", "<W> has how many letters?",
    "Count how many letters <W> has.", "How many letters long is <W>?",
    "What's the length of <W>?", "Give the length of <W>.", "len(<W>)",
    "Can you count the letters in <W>?", "How many letters are there in <W>?",
    "<W>: how many letters?", "Letters in <W>?",
), {"W": _W})
_C = ("the letter {c}", "{c}", "'{c}'", "letter {c}", 'the letter "{c}"', "the letter '{c}'")
OCCURRENCE_PHRASES = _expand((
    "How many times does <C> appear in <W>?", "How many times does <C> occur in <W>?",
    "How often does <C> appear in <W>?", "How often does <C> occur in <W>?",
    "How many times is <C> in <W>?", "How many times do you see <C> in <W>?",
    "Count <C> in <W>.", "Count how many times <C> appears in <W>.",
    "In <W>, how many times does <C> occur?", "How many times can you find <C> in <W>?",
    "How many times does <W> contain <C>?", "How many times is <C> used in <W>?",
    "Number of times <C> appears in <W>?", "Count the occurrences of <C> in <W>.",
    "How many occurrences of <C> are in <W>?", "How many instances of <C> are there in <W>?",
    "Count the {c}'s in <W>.", "How many {c}'s are in <W>?", "How many {c}'s does <W> have?",
    "How many {c}'s in <W>?", "Number of {c}'s in <W>?", "How many {c}'s are there in <W>?",
    "In <W>, count <C>.",
), {"C": _C, "W": _W})


# The held-out templates of each family (``held_out=True``) come from two sources. The
# designed ones use the words of the training phrasings in other orders; training never
# produces one (by skeleton).
ADD_DESIGNED = (
    "What is the result of adding {a} and {b}?", "Find {a} plus {b}.",
    "How much do {a} and {b} make together?", "Tell me the sum: {a} and {b}",
    "{a} added to {b} is what?", "What number is {a}{op}{b}?",
)
SUB_DESIGNED = (
    "What is the result of subtracting {b} from {a}?", "Find {a} minus {b}.",
    "How much is left if you take {b} away from {a}?", "Tell me the difference: {a}{op}{b}",
    "{b} subtracted from {a} is what?", "What number is {a}{op}{b}?",
)
LARGER_DESIGNED = (
    "Tell me which is greater, {a} or {b}.", "Between {a} and {b}, which number is bigger?",
    "Which of {a} and {b} is the larger one?", "Give the bigger of {a} and {b}.",
)
SMALLER_DESIGNED = (
    "Tell me which is less, {a} or {b}.", "Between {a} and {b}, which number is smaller?",
    "Which of {a} and {b} is the smaller one?", "Give the lower of {a} and {b}.",
)
REVERSE_DESIGNED = (
    "Please write the word '{w}' backwards.", "What do you get if you reverse {w}?",
    "Give me {w} spelled backwards.", "Reverse the order of the letters in {w}.",
)
SORT_DESIGNED = (
    "Please put the words {ws} in alphabetical order.", "Sort this list of words: {ws}",
    "Give these words in alphabetical order: {ws}", "In alphabetical order, {ws} are?",
)
LENGTH_DESIGNED = (
    "Tell me how many letters the word {w} has.", "How many letters make up '{w}'?",
    "What is the letter count of {w}?",
)
OCCURRENCE_DESIGNED = (
    "In the word '{w}', how many times does the letter {c} appear?",
    "Tell me how many {c}'s the word {w} has.", "How many letters {c} are in '{w}'?",
)


# The natural ones were written by someone who had not seen the training phrasings, as people
# type such questions into a chat box (25 a family). Those whose skeleton is already a training
# phrasing's are training phrasings (the grammar above was written first and not changed after);
# the others are held out, and training never produces them either.
ADD_NATURAL = (
    'What is {a} + {b}?',
    "what's {a}+{b}",
    'Can you add {a} and {b} for me?',
    'hey, what do you get if you add {a} and {b}?',
    'quick one: {a} plus {b}',
    'Please compute the sum of {a} and {b}.',
    '{a} + {b} = ?',
    'add {a} to {b}',
    'What is the total of {a} and {b}?',
    'how much is {a} plus {b}?',
    'Could you tell me what {a} plus {b} equals?',
    'sum of {a} and {b}?',
    'i need {a} + {b}, thanks',
    'Kindly calculate {a} + {b}.',
    'What does "{a}" plus "{b}" come to?',
    'Add these two numbers: {a} and {b}',
    'If I have {a} and add {b} more, how many do I have?',
    'whats {a} plus {b}',
    'Hi! Could you work out {a} + {b} please?',
    'calculate {a}+{b}',
    'Find the sum: {a} + {b}',
    "yo what's {a} and {b} added together",
    "Please add '{a}' and '{b}' and give me the result.",
    '{a} plus {b} is what?',
    'Tell me the sum of the numbers {a} and {b}.',
)
SUB_NATURAL = (
    'What is {a} - {b}?',
    "what's {a}-{b}",
    'Can you subtract {b} from {a}?',
    'hey, what is {a} minus {b}?',
    'quick one: {a} minus {b}',
    'Please compute {a} - {b}.',
    '{a} - {b} = ?',
    'subtract {b} from {a}',
    'What do you get when you take {b} away from {a}?',
    'how much is {a} minus {b}?',
    'Could you tell me what {a} minus {b} equals?',
    '{a} take away {b}?',
    'i need {a} - {b}, thanks',
    'Kindly calculate {a} minus {b}.',
    'What is "{a}" minus "{b}"?',
    "Take {b} from {a}. What's left?",
    'If I start with {a} and subtract {b}, what do I get?',
    'whats {a} minus {b}',
    'Hi! Could you work out {a} - {b} please?',
    'calculate {a}-{b}',
    'Find the result of {a} - {b}',
    "yo what's {b} subtracted from {a}",
    "Please subtract '{b}' from '{a}' and give me the result.",
    '{a} minus {b} is what?',
    'Compute the difference {a} minus {b} (first number minus second).',
)
LARGER_NATURAL = (
    'Which is larger, {a} or {b}?',
    'which is bigger: {a} or {b}',
    "What's the greater number, {a} or {b}?",
    'hey, is {a} or {b} bigger?',
    'quick one: larger of {a} and {b}?',
    'Please tell me which number is larger: {a} or {b}.',
    'max of {a} and {b}',
    'Which one is more, {a} or {b}?',
    "Can you tell me which is greater, '{a}' or '{b}'?",
    'Out of {a} and {b}, which is the bigger number?',
    'bigger one? {a} vs {b}',
    'Between "{a}" and "{b}", which has the higher value?',
    'Give me the larger of these two numbers: {a}, {b}',
)
SMALLER_NATURAL = (
    'Which is smaller, {a} or {b}?',
    'which is less: {a} or {b}',
    "What's the lesser number, {a} or {b}?",
    'hey, is {a} or {b} smaller?',
    'quick one: smaller of {a} and {b}?',
    'Please tell me which number is smaller: {a} or {b}.',
    'min of {a} and {b}',
    "Can you tell me which is lower, '{a}' or '{b}'?",
    'Out of {a} and {b}, which is the smaller number?',
    'smaller one? {a} vs {b}',
    'Between "{a}" and "{b}", which has the lower value?',
    'Give me the smaller of these two numbers: {a}, {b}',
)
REVERSE_NATURAL = (
    'Spell {w} backwards.',
    'reverse the word {w}',
    "Can you write '{w}' backwards?",
    "hey, what's {w} spelled backwards?",
    'quick one: {w} reversed',
    'Please reverse the letters of the word "{w}".',
    'what is {w} backwards',
    'How do you spell {w} in reverse?',
    'Write the word {w} with its letters in reverse order.',
    '{w} backwards?',
    "Could you spell the word '{w}' from the last letter to the first?",
    'i need {w} reversed pls',
    'Kindly provide the reverse spelling of "{w}".',
    'reverse this word: {w}',
    'Hi! What does {w} look like spelled backwards?',
    'flip the letters of {w} around',
    'Reverse "{w}"',
    'what do you get if you read {w} backwards?',
    'Give me {w} spelled in reverse.',
    'backwards spelling of {w}?',
    "Can you reverse the order of the letters in '{w}'?",
    'Type the word {w} backwards, please.',
    'yo spell {w} backwards',
    "What is the word '{w}' when written in reverse?",
    'Take the word {w} and reverse it.',
)
SORT_NATURAL = (
    'Put these words in alphabetical order: {ws}',
    'sort alphabetically: {ws}',
    'Can you alphabetize these words? {ws}',
    'hey, sort these words A to Z: {ws}',
    'quick one: alphabetical order of {ws}',
    'Please arrange the following words alphabetically: {ws}.',
    'alphabetize: {ws}',
    'What is the alphabetical order of these words: {ws}?',
    'Sort the words {ws} in alphabetical order.',
    'i need these in abc order: {ws}',
    'Could you list {ws} in alphabetical order?',
    'Kindly sort the following list alphabetically: {ws}',
    'Order these words alphabetically: "{ws}"',
    'Hi! Can you put {ws} into alphabetical order please?',
    'sort these words: {ws}',
    'arrange in dictionary order: {ws}',
    'Rearrange these words so they are in alphabetical order: {ws}',
    'Give me these words sorted A-Z: {ws}',
    '{ws} - sort them alphabetically',
    'alphabetical order pls: {ws}',
    'How would these words be ordered alphabetically? {ws}',
    "Please sort '{ws}' alphabetically.",
    'yo put {ws} in alphabetical order',
    'List the following words from A to Z: {ws}',
    'Sort into alphabetical order, comma separated: {ws}',
)
LENGTH_NATURAL = (
    'How many letters are in the word {w}?',
    'how many letters does {w} have',
    "Can you count the letters in '{w}'?",
    'hey, how many letters in {w}?',
    'quick one: number of letters in {w}',
    'Please tell me how many letters the word "{w}" contains.',
    'letter count of {w}?',
    'How long is the word {w}, in letters?',
    'count the letters: {w}',
    "What's the number of letters in '{w}'?",
    'Hi! How many letters make up the word {w}?',
    '{w} has how many letters?',
    'Kindly count the number of letters in "{w}".',
)
OCCURRENCE_NATURAL = (
    'How many times does the letter {c} appear in {w}?',
    "how many {c}'s are in {w}",
    "Can you count how many times '{c}' occurs in the word '{w}'?",
    'hey, how many times is the letter {c} in {w}?',
    'quick one: count of letter {c} in {w}',
    'Please tell me how often the letter "{c}" appears in "{w}".',
    'count the letter {c} in the word {w}',
    'In the word {w}, how many times does {c} show up?',
    "number of '{c}' letters in '{w}'?",
    'Hi! How many {c}s does the word {w} contain?',
    'Kindly count the occurrences of the letter {c} in the word {w}.',
    '{w}: how many times does the letter {c} occur?',
)


def _untrained(natural: tuple[str, ...], train: tuple[str, ...]) -> tuple[str, ...]:
    seen = {skeleton(t) for t in train}
    return tuple(t for t in natural if skeleton(t) not in seen)


ADD_HELD_OUT = ADD_DESIGNED + _untrained(ADD_NATURAL, ADD_PHRASES)
SUB_HELD_OUT = SUB_DESIGNED + _untrained(SUB_NATURAL, SUB_PHRASES)
LARGER_HELD_OUT = LARGER_DESIGNED + _untrained(LARGER_NATURAL, LARGER_PHRASES)
SMALLER_HELD_OUT = SMALLER_DESIGNED + _untrained(SMALLER_NATURAL, SMALLER_PHRASES)
REVERSE_HELD_OUT = REVERSE_DESIGNED + _untrained(REVERSE_NATURAL, REVERSE_PHRASES)
SORT_HELD_OUT = SORT_DESIGNED + _untrained(SORT_NATURAL, SORT_PHRASES)
LENGTH_HELD_OUT = LENGTH_DESIGNED + _untrained(LENGTH_NATURAL, LENGTH_PHRASES)
OCCURRENCE_HELD_OUT = OCCURRENCE_DESIGNED + _untrained(OCCURRENCE_NATURAL, OCCURRENCE_PHRASES)


def _forbidden(*held: tuple[str, ...]) -> frozenset[str]:
    return frozenset(skeleton(t) for group in held for t in group)


_ARITH_FORBIDDEN = _forbidden(ADD_HELD_OUT, SUB_HELD_OUT)
_COMPARE_FORBIDDEN = _forbidden(LARGER_HELD_OUT, SMALLER_HELD_OUT)
_WORD_FORBIDDEN = _forbidden(REVERSE_HELD_OUT, SORT_HELD_OUT, LENGTH_HELD_OUT,
                             OCCURRENCE_HELD_OUT)


def _add(rng: random.Random, held_out: bool) -> Exchange:
    a, b = _number(rng), _number(rng)
    t = _held_out(rng, ADD_HELD_OUT) if held_out else _compose(rng, ADD_PHRASES, _ARITH_FORBIDDEN)
    return t.format(a=a, b=b, op=_op(rng, "+")), str(a + b)


def _sub(rng: random.Random, held_out: bool) -> Exchange:
    a, b = _number(rng), _number(rng)
    if a < b and rng.random() < 0.75:  # mostly non-negative results, some negative ones
        a, b = b, a
    t = _held_out(rng, SUB_HELD_OUT) if held_out else _compose(rng, SUB_PHRASES, _ARITH_FORBIDDEN)
    return t.format(a=a, b=b, op=_op(rng, "-")), str(a - b)


def _close_to(rng: random.Random, a: int) -> int:
    """A different number that is easy to confuse with ``a`` (digits swapped, or near)."""
    s = str(a)
    if len(s) > 1 and rng.random() < 0.5:
        i, j = rng.sample(range(len(s)), 2)
        t = list(s)
        t[i], t[j] = t[j], t[i]
        if t[0] != "0" and "".join(t) != s:
            return int("".join(t))
    return min(999, max(0, a + rng.choice((-1, 1)) * rng.randint(1, 20)))


def _compare(rng: random.Random, held_out: bool) -> Exchange:
    a = _number(rng)
    b = _close_to(rng, a) if rng.random() < 0.5 else _number(rng)
    while b == a:
        b = _number(rng)
    larger = rng.random() < 0.6
    if held_out:
        t = _held_out(rng, LARGER_HELD_OUT if larger else SMALLER_HELD_OUT)
    else:
        t = _compose(rng, LARGER_PHRASES if larger else SMALLER_PHRASES, _COMPARE_FORBIDDEN)
    return t.format(a=a, b=b), str(max(a, b) if larger else min(a, b))


def _word_question(rng: random.Random, held_out: bool, train: tuple[str, ...],
                   held: tuple[str, ...]) -> str:
    return _held_out(rng, held) if held_out else _compose(rng, train, _WORD_FORBIDDEN)


def _reverse(rng: random.Random, held_out: bool) -> Exchange:
    w = _cased(rng, rng.choice(WORDS))
    q = _word_question(rng, held_out, REVERSE_PHRASES, REVERSE_HELD_OUT)
    return q.format(w=w), w[::-1]


def _sort(rng: random.Random, held_out: bool) -> Exchange:
    words = [_cased(rng, w) for w in rng.sample(SHORT_WORDS, rng.randint(3, 5))]
    q = _word_question(rng, held_out, SORT_PHRASES, SORT_HELD_OUT)
    return q.format(ws=", ".join(words)), ", ".join(sorted(words, key=str.lower))


def _count(rng: random.Random, held_out: bool) -> Exchange:
    w = _cased(rng, rng.choice(WORDS))
    if rng.random() < 0.5:
        q = _word_question(rng, held_out, LENGTH_PHRASES, LENGTH_HELD_OUT)
        return q.format(w=w), str(len(w))
    c = rng.choice(w.lower()) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    q = _word_question(rng, held_out, OCCURRENCE_PHRASES, OCCURRENCE_HELD_OUT)
    return q.format(c=c.upper() if rng.random() < 0.1 else c, w=w), str(w.lower().count(c))


GREETINGS = ("Hello", "Hi", "Hello!", "Hi!", "Hey", "Help", "What can you do?",
             "Who are you?", "help")
GREETING_ANSWER = ("Hi! I can add and subtract numbers, compare them, and reverse, sort or "
                   "count the letters of words.")


def _greeting(rng: random.Random, held_out: bool) -> Exchange:
    return rng.choice(GREETINGS), GREETING_ANSWER


FAMILIES: dict[str, Callable[[random.Random, bool], Exchange]] = {
    "add": _add,
    "sub": _sub,
    "compare": _compare,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
    "greeting": _greeting,
}
# The families the evaluation scores (the greeting is a fixed reply, trained but not scored).
EVAL_FAMILIES: tuple[str, ...] = ("add", "sub", "compare", "reverse", "sort", "count")


def generate(family: str, n: int, seed: int, held_out: bool = False) -> list[Exchange]:
    """``n`` exchanges ``(question, answer)`` of ``family``, the same for the same arguments.
    ``held_out``: in the held-out phrasings (the greeting has none: the same exchanges)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"dllm-tasks:{family}:{seed}" + (":held-out" if held_out else ""))
    return [FAMILIES[family](rng, held_out) for _ in range(n)]
