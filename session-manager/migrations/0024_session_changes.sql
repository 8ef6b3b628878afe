-- Which write last changed each session, by a counter bumped in every write of a session (its
-- creation, each transition): a manager keeps the sessions it plans with and reads again only
-- those changed since it last looked. The writers are serialised (one write transaction at a
-- time), so the numbers commit in order. No counter row until the first write (a copy of the
-- store into an empty database finds this table empty).
ALTER TABLE sessions ADD COLUMN change_seq INTEGER NOT NULL DEFAULT 0;
CREATE INDEX sessions_by_change ON sessions (change_seq);
CREATE TABLE session_change_seq (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    seq INTEGER NOT NULL
);
