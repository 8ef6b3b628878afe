-- ongrid-manager schema, version 4: the session lifecycle (connect deadline, idle, maximum
-- lifetime, keep-alive). Never edit a migration once released. Times are RFC 3339 UTC text with
-- nanoseconds, as in 0001, and always the manager's own clock.

-- The facts the hold policy is computed from, one row per session that has any (a session
-- without a row has the site's defaults and has seen nothing yet). Every deadline follows from
-- these absolute times, so a manager restart resumes every countdown where it was.
--   idle_timeout_secs, max_duration_secs: the session's own values (NULL: the site's default).
--   first_started_at: when the container first ran (the maximum lifetime counts from it).
--   ready_at: when it last became WAITING (after a start or a release).
--   last_close_at: when its last SSH connection closed.
--   last_traffic_at: when a gateway last reported bytes moving on one of its connections.
--   cpu_active_at / gpu_active_at: the last agent sample at or above the site's threshold;
--   cpu_sampled_at, cpu_percent, gpu_sampled_at, gpu_percent: the last sample, whatever its value.
--   keep_until: the end of the last `devctl session keep`.
CREATE TABLE session_lifecycle (
    session_id         TEXT COLLATE "C" PRIMARY KEY NOT NULL REFERENCES sessions(id),
    idle_timeout_secs  BIGINT,
    max_duration_secs  BIGINT,
    first_started_at   TEXT COLLATE "C",
    ready_at           TEXT COLLATE "C",
    last_close_at      TEXT COLLATE "C",
    last_traffic_at    TEXT COLLATE "C",
    cpu_active_at      TEXT COLLATE "C",
    cpu_sampled_at     TEXT COLLATE "C",
    cpu_percent        DOUBLE PRECISION,
    gpu_active_at      TEXT COLLATE "C",
    gpu_sampled_at     TEXT COLLATE "C",
    gpu_percent        DOUBLE PRECISION,
    keep_until         TEXT COLLATE "C"
);

-- When the gateway last said this connection is open (its open or a periodic activity report).
-- An open connection not reported for `connection_stale_after` no longer keeps its session alive,
-- so a gateway that died without closing its connections cannot keep GPUs forever.
ALTER TABLE connections ADD COLUMN last_report_at TEXT COLLATE "C";

-- Connections open when this runs were reported by a gateway that may not report them yet: count
-- them as reported now, so that an upgrade does not hold a session someone is connected to.
UPDATE connections
SET last_report_at = to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS') || '.000000000Z'
WHERE closed_at IS NULL;
