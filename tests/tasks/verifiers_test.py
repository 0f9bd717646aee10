"""The verifiers: math-verify's reading of MATH-style answers (right and wrong ones of each
kind), references taken from dataset fields as written, the numeric verifier refusing what
it would mangle, and the registry's errors."""

import concurrent.futures
import pickle

import math_verify
import pytest

from m2po_jax.tasks.verifiers import (
    VERIFIERS,
    MathVerifier,
    NumericVerifier,
    Verifier,
    extract_reference,
    last_boxed,
    make_verifier,
)

# (reference, completion, reward): a right and a wrong answer of each kind.
MATH_CASES = [
    # fractions
    (r"\frac{1}{2}", "0.5", 1.0),
    (r"\frac{1}{2}", "The answer is 2", 0.0),
    (r"\frac{1}{2}", r"so \boxed{\frac{2}{4}}", 1.0),
    (r"\frac{1}{2}", r"so \boxed{\frac{\sqrt{4}}{4}}", 1.0),  # nested braces in the box
    (r"\frac{1}{2}", r"so \boxed{\frac{\sqrt{4}}{2}}", 0.0),
    (r"\dfrac{3}{4}", r"\boxed{0.75}", 1.0),
    (r"\dfrac{3}{4}", r"\boxed{\frac{4}{3}}", 0.0),
    (r"-\frac{3}{2}", r"\boxed{-1.5}", 1.0),
    (r"-\frac{3}{2}", r"\boxed{1.5}", 0.0),
    # radicals
    (r"3\sqrt{2}", r"\boxed{\sqrt{18}}", 1.0),
    (r"3\sqrt{2}", r"\boxed{2\sqrt{3}}", 0.0),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{1}{2}\sqrt{3}}", 1.0),
    (r"\sqrt[3]{2}", r"\boxed{2^{1/3}}", 1.0),
    # intervals
    ("[1, 3)", r"\boxed{[1, 3)}", 1.0),
    ("[1, 3)", r"\boxed{[1, 3]}", 0.0),
    ("[1, 3)", r"\boxed{(1, 3)}", 0.0),
    (r"(-\infty, 2]", r"\boxed{(-\infty, 2]}", 1.0),
    (r"(-\infty, 2]", r"\boxed{(-\infty, 2)}", 0.0),
    ("(2, 3)", r"\boxed{(2,3)}", 1.0),
    ("(2, 3)", r"\boxed{(3,2)}", 0.0),  # the tuple the other way round
    # tuples / points
    ("(1, -2)", r"the point is \boxed{(1,-2)}", 1.0),
    ("(1, -2)", r"\boxed{(-2, 1)}", 0.0),
    ("(1, 2, 3)", r"\boxed{(1,2,3)}", 1.0),
    ("(1, 2, 3)", r"\boxed{(3,2,1)}", 0.0),
    # sets
    (r"\{1,2\}", r"\boxed{\{2,1\}}", 1.0),
    (r"\{1,2\}", r"\boxed{\{1,3\}}", 0.0),
    (r"\pm 2", r"\boxed{2, -2}", 1.0),
    (r"\pm 2", r"\boxed{2}", 0.0),
    # polynomials and expressions
    ("x^2+1", r"\boxed{1+x^2}", 1.0),
    ("x^2+1", r"\boxed{(x+1)^2}", 0.0),
    (r"\frac{x+1}{2}", r"\boxed{\frac{x}{2}+\frac{1}{2}}", 1.0),
    ("2 + 3i", r"\boxed{3i+2}", 1.0),
    ("2 + 3i", r"\boxed{2-3i}", 0.0),
    # matrices
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", 1.0),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\boxed{\begin{pmatrix} 2 \\ 1 \end{pmatrix}}", 0.0),
    # text answers
    (r"\text{Monday}", r"\boxed{\text{Monday}}", 1.0),
    (r"\text{Monday}", r"\boxed{Monday}", 1.0),
    (r"\text{Monday}", r"\boxed{\text{Tuesday}}", 0.0),
    (r"\text{(A)}", r"\boxed{A}", 1.0),
    (r"\text{(A)}", r"\boxed{B}", 0.0),
    # negative numbers
    ("-5", r"\boxed{-5}", 1.0),
    ("-5", "the answer is -5", 1.0),
    ("-5", r"\boxed{5}", 0.0),
    # percentages, degrees, units, dollars
    (r"25\%", r"\boxed{25\%}", 1.0),
    (r"25\%", r"\boxed{25}", 1.0),
    (r"25\%", r"\boxed{26\%}", 0.0),
    (r"90^\circ", r"\boxed{90}", 1.0),
    (r"90^\circ", r"\boxed{45^\circ}", 0.0),
    (r"12\text{ cm}", r"\boxed{12 \text{ cm}}", 1.0),
    (r"12\text{ cm}", r"\boxed{13}", 0.0),
    (r"\$18", r"\boxed{18}", 1.0),
    ("18", r"\boxed{18 \text{ dollars}}", 1.0),
    ("18", r"\boxed{\$19}", 0.0),
    # plain numbers as a user writes them, read as numbers (not 1*e*3)
    ("1e3", r"\boxed{1000}", 1.0),
    ("1e3", r"\boxed{3}", 0.0),
    ("1e3", r"\boxed{1}", 0.0),
    ("1,000", r"\boxed{1000}", 1.0),
    ("1,000", r"\boxed{100}", 0.0),
    ("0.5", r"\boxed{\frac12}", 1.0),
    ("0.5", r"\boxed{\frac13}", 0.0),
    # no answer at all
    ("7", "I do not know", 0.0),
    # \fbox counts as a box
    ("3", r"so \fbox{3}", 1.0),
    ("3", r"so \fbox{4}", 0.0),
]


@pytest.mark.parametrize("reference, completion, reward", MATH_CASES)
def test_math_verifier_table(reference, completion, reward):
    assert MathVerifier()(completion, reference) == reward


def test_math_check_reference_accepts_the_table_and_refuses_what_it_cannot_read():
    verifier = MathVerifier()
    for reference, _, _ in MATH_CASES:
        verifier.check_reference(reference)
    verifier.check_reference(r"$\frac{1}{2}$")  # already delimited
    with pytest.raises(ValueError, match="^empty reference$"):
        verifier.check_reference("  ")
    # "???" is read only as math-verify's raw-string fallback; its expression reader picks a
    # number out of the other two ("0", "3"), not the whole reference.
    for bad in ("???", r"0.\overline{3}", r"\approx 3"):
        with pytest.raises(ValueError) as e:
            verifier.check_reference(bad)
        assert str(e.value) == (
            f"math-verify cannot read {bad!r} as LaTeX, a number or an expression"
        )
        with pytest.raises(ValueError, match="math-verify cannot read"):
            verifier(r"\boxed{3}", bad)  # unchecked: refused, not scored 0


def test_math_several_boxes_are_one_set_answer():
    verifier = MathVerifier()
    assert verifier(r"\boxed{5}, so again \boxed{5}", "5") == 1.0
    assert verifier(r"\boxed{3} or \boxed{5}", "5") == 0.0  # hedging scores 0
    assert verifier(r"\boxed{3} or \boxed{5}", r"\{3, 5\}") == 1.0


def test_math_verifier_runs_outside_the_main_thread():
    """math-verify's own timeouts use signal.alarm, which raises off the main thread."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rewards = list(
            pool.map(MathVerifier(), [r"\boxed{0.5}", r"\boxed{3}"], [r"\frac{1}{2}"] * 2)
        )
    assert rewards == [1.0, 0.0]


def test_math_reference_is_parsed_once_per_string(monkeypatch):
    calls = []
    parse = math_verify.parse

    def counting_parse(text, *args, **kwargs):
        calls.append(text)
        return parse(text, *args, **kwargs)

    monkeypatch.setattr(math_verify, "parse", counting_parse)
    verifier = MathVerifier()
    completions = [r"\boxed{\frac{6}{14}}", r"\boxed{3}", "0.4285714"]
    assert [verifier(c, r"\frac{3}{7}") for c in completions] == [1.0, 0.0, 1.0]
    assert sum(call == r"$\frac{3}{7}$" for call in calls) == 1
    assert len(calls) == 1 + len(completions)


def test_last_boxed():
    assert last_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\frac{\sqrt{3}}{2}}") == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{2} finally \boxed{ 3 }") == " 3 "
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{1} and \fbox{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"\boxed {4}") == "4"
    assert last_boxed(r"\boxed{}") == ""
    assert last_boxed("no box, 42") is None
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced
    assert last_boxed(r"\boxed{1} then \boxed{2") is None  # the last box does not close
    assert last_boxed(r"\boxed") is None


def test_extract_reference_keeps_the_text_as_written():
    assert extract_reference(r"Half of one is $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert extract_reference(r"\boxed{1} no, \boxed{ 2 }") == "2"
    assert extract_reference(r"\fbox{(2, 3)}") == "(2, 3)"
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = 72\n#### 72"
    assert extract_reference(solution) == "72"
    assert extract_reference("a #### b #### 1,002 ") == "1,002"
    assert extract_reference("  -3\n") == "-3"
    for raw in ("1/3", "1e3", "x^2+1", "(2, 3)", "$18", "15%"):
        assert extract_reference(raw) == raw  # never converted
    assert extract_reference("#### 1/3") == "1/3"
    assert extract_reference(r"\boxed{\frac{1}{2}") == r"\boxed{\frac{1}{2}"  # unbalanced: whole


@pytest.mark.parametrize("reference", ["1/3", r"\frac{1}{2}", "1e3", "x^2+1", "(2, 3)", "1 2"])
def test_numeric_refuses_what_it_would_mangle(reference):
    verifier = NumericVerifier()
    expected = (
        f"{reference!r} is not a plain number; task.verifier='math' reads fractions, LaTeX, "
        "intervals and tuples"
    )
    with pytest.raises(ValueError) as e:
        verifier.check_reference(reference)
    assert str(e.value) == expected
    with pytest.raises(ValueError, match="task.verifier='math'"):
        verifier("the answer is 3", reference)  # unchecked: refused, not scored


def test_numeric_refuses_empty_and_malformed_numbers():
    verifier = NumericVerifier()
    with pytest.raises(ValueError, match="^empty reference$"):
        verifier.check_reference(" ")
    for bad in ("1,2,3", "12,34", "--5", "5-", ".5", "+5", "1.", "five", "72 apples"):
        with pytest.raises(ValueError, match="is not a plain number"):
            verifier.check_reference(bad)


@pytest.mark.parametrize(
    "reference, right, wrong",
    [
        ("72", "so she sold 72", "so she sold 73"),
        ("1,234", "The total is 1234.", "The total is 1,243."),
        ("1,234", "The total is $1,234.00", "1,234 + 1 = 1,235"),
        ("-5", "the change is -5", "the change is 5"),
        ("$18", "She makes $18 every day.", "She makes $81 every day."),
        ("-$5", "she is -$5 down", "she is $5 up"),
        ("0.5", "It takes 0.5 hours", "It takes 5 hours"),
        ("15%", "a rise of 15%", "a rise of 1.5%"),
        (" 16\n", "16", "61"),
    ],
)
def test_numeric_reads_plain_numbers(reference, right, wrong):
    verifier = NumericVerifier()
    verifier.check_reference(reference)
    assert verifier(right, reference) == 1.0
    assert verifier(wrong, reference) == 0.0
    assert verifier("no number here", reference) == 0.0


def test_make_verifier():
    assert sorted(VERIFIERS) == ["math", "numeric"]
    for name, cls in (("math", MathVerifier), ("numeric", NumericVerifier)):
        verifier = make_verifier(name)
        assert type(verifier) is cls and isinstance(verifier, Verifier)
        assert verifier.name == name
        # The scorer ships verifiers to worker processes.
        assert type(pickle.loads(pickle.dumps(verifier))) is cls
    assert MathVerifier.may_hang and not NumericVerifier.may_hang
    for bad in ("sympy", "Math", ""):
        with pytest.raises(ValueError) as e:
            make_verifier(bad)
        assert str(e.value) == (
            f"task.verifier: unknown {bad!r}; expected one of ['math', 'numeric']"
        )
