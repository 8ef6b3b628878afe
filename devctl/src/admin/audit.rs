//! `devctl admin audit` (`GET /v1/audit[?user=DN][&since=RFC3339]`): the SSH connections to
//! sessions, newest first: who, from where, with which key, how much.

use std::str::FromStr;

use chrono::{DateTime, NaiveDate, SecondsFormat, Utc};
use clap::Args;
use ongrid_core::api::AuditRecord;
use ongrid_core::{Dn, HumanDuration};

use crate::client::Client;
use crate::format::{format_bytes, format_time};
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Clone, Args)]
pub struct AuditArgs {
    /// Only this user's connections, by DN like "/DC=org/DC=example/CN=Alice Smith"
    #[arg(long, value_name = "DN")]
    pub user: Option<Dn>,
    /// Only connections opened since a time (2026-11-21T10:00:00Z, 2026-11-21) or for a
    /// duration until now (2h, "3 days")
    #[arg(long, value_name = "TIME|DURATION")]
    pub since: Option<Since>,
    #[command(flatten)]
    pub output: JsonArgs,
}

/// `--since`: a moment, or how long ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    At(DateTime<Utc>),
    Ago(HumanDuration),
}

impl Since {
    /// The moment meant, with `now` for a duration.
    pub fn resolve(self, now: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            Self::At(at) => at,
            Self::Ago(ago) => chrono::Duration::from_std(ago.as_duration())
                .ok()
                .and_then(|ago| now.checked_sub_signed(ago))
                .unwrap_or(DateTime::<Utc>::MIN_UTC),
        }
    }
}

impl FromStr for Since {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let trimmed = value.trim();
        // RFC 3339, or the way devctl prints times (`2026-11-21 10:00:03Z`).
        if let Ok(at) = DateTime::parse_from_rfc3339(&trimmed.replacen(' ', "T", 1)) {
            return Ok(Self::At(at.with_timezone(&Utc)));
        }
        if let Ok(day) = NaiveDate::parse_from_str(trimmed, "%Y-%m-%d") {
            return Ok(Self::At(day.and_time(chrono::NaiveTime::MIN).and_utc()));
        }
        HumanDuration::parse(trimmed).map(Self::Ago).map_err(|_| {
            format!(
                "{value:?} must be a time like 2026-11-21T10:00:00Z or 2026-11-21 (UTC), or a \
                 duration like 2h or \"3 days\" (that long ago)"
            )
        })
    }
}

pub async fn run(args: AuditArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let since = args.since.map(|since| since.resolve(Utc::now()));
    let records: Vec<AuditRecord> = client
        .get("v1/audit")
        .query(&query(args.user.as_ref(), since))
        .send()
        .await?;
    let filtered = args.user.is_some() || since.is_some();
    let width = term.width;
    term.show(args.output.json, &records, |records| {
        render_audit(records, filtered, width)
    })
}

/// The query of `GET /v1/audit`: `user=DN`, `since=RFC 3339` (to the second, `Z`).
pub fn query(user: Option<&Dn>, since: Option<DateTime<Utc>>) -> Vec<(&'static str, String)> {
    let mut query = Vec::new();
    if let Some(user) = user {
        query.push(("user", user.as_str().to_owned()));
    }
    if let Some(since) = since {
        query.push(("since", since.to_rfc3339_opts(SecondsFormat::Secs, true)));
    }
    query
}

/// `devctl admin audit`: one row per connection, in the manager's order (newest first).
/// `filtered` says whether `--user` or `--since` narrowed the list. Wrapped to `width` (the
/// terminal's) when given.
pub fn render_audit(records: &[AuditRecord], filtered: bool, width: Option<u16>) -> String {
    if records.is_empty() {
        return if filtered {
            "no SSH connections match --user/--since\n".to_owned()
        } else {
            "no SSH connections recorded\n".to_owned()
        };
    }
    let mut table = Table::new(&[
        "OPENED",
        "CLOSED",
        "USER",
        "KEY",
        "SOURCE",
        "INSTITUTE",
        "SESSION",
        "IN",
        "OUT",
    ]);
    // Times, fingerprints, addresses and byte counts stay whole; users and sessions wrap.
    table.keep_whole(&[0, 1, 3, 4, 7, 8]);
    for r in records {
        table.row([
            format_time(r.opened_at),
            r.closed_at.map_or_else(|| "open".to_owned(), format_time),
            r.owner.to_string(),
            r.fingerprint.clone(),
            r.source.to_string(),
            r.institute.to_string(),
            r.session_name.to_string(),
            format_bytes(r.bytes_in),
            format_bytes(r.bytes_out),
        ]);
    }
    table.render(width, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::{InstituteName, SessionId, SessionName};

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    #[test]
    fn audit_filters_become_the_query() {
        assert!(query(None, None).is_empty());
        let user = Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap();
        let since = DateTime::from_timestamp(1_795_255_200, 0);
        assert_eq!(
            query(Some(&user), since),
            vec![
                ("user", "/DC=org/DC=example/CN=Alice Smith".to_owned()),
                ("since", "2026-11-21T10:00:00Z".to_owned()),
            ]
        );
    }

    #[test]
    fn audit_rows_show_open_connections_and_traffic() {
        let record = |closed: Option<i64>, bytes_in: u64, bytes_out: u64| AuditRecord {
            connection_id: "9b2e8a4c-1d3f-4e5a-8b7c-6d5e4f3a2b1c".parse().unwrap(),
            owner: Dn::parse("/DC=org/CN=Alice").unwrap(),
            fingerprint: "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI".into(),
            source: "192.0.2.7".parse().unwrap(),
            institute: InstituteName::parse("uni-glasgow").unwrap(),
            session_id: SessionId("6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f".parse().unwrap()),
            session_name: SessionName::parse("train1").unwrap(),
            opened_at: at(60),
            closed_at: closed.map(at),
            bytes_in,
            bytes_out,
            close_reason: None,
        };
        let records = [record(None, 0, 0), record(Some(90), 1536, 12 << 20)];
        assert_eq!(
            render_audit(&records, false, None),
            "OPENED                CLOSED                USER              KEY                                                 SOURCE     INSTITUTE    SESSION  IN       OUT
2026-11-21 10:01:00Z  open                  /DC=org/CN=Alice  SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  192.0.2.7  uni-glasgow  train1   0 B      0 B
2026-11-21 10:01:00Z  2026-11-21 10:01:30Z  /DC=org/CN=Alice  SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  192.0.2.7  uni-glasgow  train1   1.5 KiB  12.0 MiB
"
        );
        assert_eq!(
            render_audit(&[], false, None),
            "no SSH connections recorded\n"
        );
        assert_eq!(
            render_audit(&[], true, None),
            "no SSH connections match --user/--since\n"
        );
    }
}
