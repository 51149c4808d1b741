import gradhub


def test_all_names_exist_and_are_sorted() -> None:
    for name in gradhub.__all__:
        assert hasattr(gradhub, name), name
    assert list(gradhub.__all__) == sorted(gradhub.__all__, key=str)


def test_public_names() -> None:
    expected = {
        "GradhubError",
        "ShapeMismatchError",
        "ClosedError",
        "UnknownParameterError",
        "ParameterServer",
    }
    assert expected <= set(gradhub.__all__)
