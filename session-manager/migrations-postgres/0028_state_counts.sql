-- How many sessions and jobs are in each state, kept by the database as rows change: `/metrics`
-- reads these few rows at each scrape instead of counting the tables (a count by the index
-- still read the rows changed since the last vacuum, about 25 ms on a busy site of 20,000
-- jobs). Triggers keep it for every writer and every replica; a count that reaches zero stays a
-- row of 0.
--
-- The tables' writers wait until the triggers exist: a replica still running the release before
-- (replicas are upgraded one at a time) writes meanwhile, and a write that committed after the
-- fill below read the tables, but before the triggers existed, would never be counted.
LOCK TABLE sessions, jobs IN SHARE ROW EXCLUSIVE MODE;
CREATE TABLE state_counts (
    kind  TEXT COLLATE "C" NOT NULL CHECK (kind IN ('session', 'job')),
    state TEXT COLLATE "C" NOT NULL,
    n     BIGINT NOT NULL,
    PRIMARY KEY (kind, state)
);
INSERT INTO state_counts (kind, state, n)
    SELECT 'session', state, COUNT(*) FROM sessions GROUP BY state;
INSERT INTO state_counts (kind, state, n)
    SELECT 'job', state, COUNT(*) FROM jobs GROUP BY state;

-- Once per statement, over the rows it inserted (`added`), deleted (`removed`) or both (an
-- update): the rows of a batched statement change the counts in one statement. Every write that
-- changes a state holds the advisory write lock, so writers never wait for each other's count
-- rows; the updates of a job's output size, outside that lock, change no count and write none.
-- TG_ARGV[0] is the kind.
CREATE FUNCTION count_states() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO state_counts AS c (kind, state, n)
            SELECT TG_ARGV[0], state, COUNT(*) FROM added GROUP BY state
            ON CONFLICT (kind, state) DO UPDATE SET n = c.n + excluded.n;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO state_counts AS c (kind, state, n)
            SELECT TG_ARGV[0], state, -COUNT(*) FROM removed GROUP BY state
            ON CONFLICT (kind, state) DO UPDATE SET n = c.n + excluded.n;
    ELSE
        -- Most updates of a row leave its state as it was: those change no count.
        INSERT INTO state_counts AS c (kind, state, n)
            SELECT TG_ARGV[0], state, SUM(delta) FROM (
                SELECT state, 1 AS delta FROM added
                UNION ALL
                SELECT state, -1 AS delta FROM removed
            ) moved GROUP BY state HAVING SUM(delta) <> 0
            ON CONFLICT (kind, state) DO UPDATE SET n = c.n + excluded.n;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER sessions_counted_in AFTER INSERT ON sessions
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION count_states('session');
CREATE TRIGGER sessions_counted_moved AFTER UPDATE ON sessions
    REFERENCING OLD TABLE AS removed NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION count_states('session');
CREATE TRIGGER sessions_counted_out AFTER DELETE ON sessions
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION count_states('session');

CREATE TRIGGER jobs_counted_in AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION count_states('job');
CREATE TRIGGER jobs_counted_moved AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS removed NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION count_states('job');
CREATE TRIGGER jobs_counted_out AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION count_states('job');
