from specloop.services.event_log import EventLog


def test_an_event_log_keeps_the_last_events_and_counts_them_all():
    log = EventLog(keep=3)
    for i in range(5):
        log.append(i)
    assert list(log) == [2, 3, 4] and len(log) == 3 and log.total == 5
    assert log.since(3) == [3, 4] and log.since(5) == [] and log.since(0) == [2, 3, 4]  # 0 and 1 are gone
    assert log.last(2) == [3, 4] and log[-1] == 4 and log[1:] == [3, 4]
