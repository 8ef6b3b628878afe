-- ongrid-manager schema, version 6: why a session was held is a typed column of its own, instead
-- of the first word of the reason sentence. Never edit a migration once released.
--
-- hold_reason: NULL, or one of the hold reasons of ongrid_core::lifecycle::HoldReason, on a
-- transition to HELD (session_transitions) and on a session whose current state is HELD
-- (sessions). `reason` then holds the details only; the reason people read is rendered as
-- "<hold_reason>: <reason>", which is what the column held before this migration.
ALTER TABLE session_transitions ADD COLUMN hold_reason TEXT COLLATE "C"
    CHECK (hold_reason IN ('no-connection', 'idle', 'max-duration', 'owner', 'admin'));
ALTER TABLE sessions ADD COLUMN hold_reason TEXT COLLATE "C"
    CHECK (hold_reason IN ('no-connection', 'idle', 'max-duration', 'owner', 'admin'));

-- Existing holds: the manager wrote them as "<hold reason>: <details>".
UPDATE session_transitions SET hold_reason = 'no-connection', reason = substr(reason, 16)
    WHERE to_state = 'HELD' AND substr(reason, 1, 15) = 'no-connection: ';
UPDATE session_transitions SET hold_reason = 'idle', reason = substr(reason, 7)
    WHERE to_state = 'HELD' AND substr(reason, 1, 6) = 'idle: ';
UPDATE session_transitions SET hold_reason = 'max-duration', reason = substr(reason, 15)
    WHERE to_state = 'HELD' AND substr(reason, 1, 14) = 'max-duration: ';
UPDATE session_transitions SET hold_reason = 'owner', reason = substr(reason, 8)
    WHERE to_state = 'HELD' AND substr(reason, 1, 7) = 'owner: ';
UPDATE session_transitions SET hold_reason = 'admin', reason = substr(reason, 8)
    WHERE to_state = 'HELD' AND substr(reason, 1, 7) = 'admin: ';

UPDATE sessions SET hold_reason = 'no-connection', reason = substr(reason, 16)
    WHERE state = 'HELD' AND substr(reason, 1, 15) = 'no-connection: ';
UPDATE sessions SET hold_reason = 'idle', reason = substr(reason, 7)
    WHERE state = 'HELD' AND substr(reason, 1, 6) = 'idle: ';
UPDATE sessions SET hold_reason = 'max-duration', reason = substr(reason, 15)
    WHERE state = 'HELD' AND substr(reason, 1, 14) = 'max-duration: ';
UPDATE sessions SET hold_reason = 'owner', reason = substr(reason, 8)
    WHERE state = 'HELD' AND substr(reason, 1, 7) = 'owner: ';
UPDATE sessions SET hold_reason = 'admin', reason = substr(reason, 8)
    WHERE state = 'HELD' AND substr(reason, 1, 7) = 'admin: ';
