//! How devctl writes values for people, the same in every command: times in UTC to the second
//! (`2026-11-21 10:00:03Z`), byte counts in binary units (`1.5 KiB`), time left (`11h 59m`).

use chrono::{DateTime, Utc};

/// A time as devctl prints it: UTC, to the second, `2026-11-21 10:00:03Z`.
pub fn format_time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%SZ").to_string()
}

/// A byte count for people: `512 B`, `1.5 KiB`, `12.0 MiB`, `3.2 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("PiB", 1 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if bytes >= size {
            return format!("{:.1} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

/// How long until `at`, for people: `11h 59m`, `2d 3h`, `45m 10s`, or `expired`.
pub fn time_left(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let seconds = (at - now).num_seconds();
    if seconds <= 0 {
        return "expired".to_owned();
    }
    let (days, hours, minutes, secs) = (
        seconds / 86_400,
        seconds % 86_400 / 3600,
        seconds % 3600 / 60,
        seconds % 60,
    );
    if days > 0 {
        format!("{days}d {hours}h")
    } else if hours > 0 {
        format!("{hours}h {minutes}m")
    } else if minutes > 0 {
        format!("{minutes}m {secs}s")
    } else {
        format!("{secs}s")
    }
}

/// A deadline for people: `2026-11-21 12:00:00Z (1h 59m left)`, or `(due now)` once passed.
pub fn deadline(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if at <= now {
        format!("{} (due now)", format_time(at))
    } else {
        format!("{} ({} left)", format_time(at), time_left(at, now))
    }
}

/// `-` for a missing value, as every table and field list shows one.
pub fn or_dash(value: Option<String>) -> String {
    value.unwrap_or_else(|| "-".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    #[test]
    fn times_are_utc_to_the_second() {
        assert_eq!(format_time(at(3)), "2026-11-21 10:00:03Z");
    }

    #[test]
    fn bytes_are_human_readable() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(12 << 20), "12.0 MiB");
        assert_eq!(format_bytes(3_435_973_837), "3.2 GiB");
    }

    #[test]
    fn time_left_is_short() {
        assert_eq!(time_left(at(3 * 86_400 + 7200 + 5), at(0)), "3d 2h");
        assert_eq!(time_left(at(3600), at(0)), "1h 0m");
        assert_eq!(time_left(at(59 * 60 + 1), at(0)), "59m 1s");
        assert_eq!(time_left(at(5), at(0)), "5s");
        assert_eq!(time_left(at(0), at(0)), "expired");
    }

    #[test]
    fn deadlines_say_how_long_is_left() {
        assert_eq!(
            deadline(at(3600), at(0)),
            "2026-11-21 11:00:00Z (1h 0m left)"
        );
        assert_eq!(deadline(at(0), at(0)), "2026-11-21 10:00:00Z (due now)");
    }
}
