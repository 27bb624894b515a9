"""canntrain's logger (runtime/log.py): information on stdout, warnings on stderr, silenced as any logger."""

import logging

from canntrain_core.runtime.log import get_logger


def test_information_goes_to_stdout_warnings_to_stderr_and_the_level_silences(capsys):
    log = get_logger("canntrain_core.train.example")
    assert log.name == "canntrain.train.example"
    log.info("resumed from step_3")
    log.warning("step 8: gradient norm 41 is 12x the median")
    out, err = capsys.readouterr()
    assert out == "resumed from step_3\n" and err == "step 8: gradient norm 41 is 12x the median\n"
    root = logging.getLogger("canntrain")
    root.setLevel(logging.WARNING)
    try:
        log.info("not shown")
        assert capsys.readouterr().out == ""
    finally:
        root.setLevel(logging.INFO)
