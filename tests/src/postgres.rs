//! A throwaway PostgreSQL server for the sites whose managers are replicas of one database
//! ([`crate::Site::start_replicated`]): Debian's `postgresql` binaries, started by the same script
//! as the manager's store tests (`session-manager/src/store/test_postgres.sh`), listening on a Unix
//! socket in its own temporary directory only. The managers use its `postgres` database. The
//! script stops the server and removes the directory when its standard input closes, which
//! dropping [`Postgres`] does (also when the test binary dies).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};

use anyhow::{bail, Context};

const SCRIPT: &str = include_str!("../../session-manager/src/store/test_postgres.sh");

/// A running server; stopped when dropped.
pub struct Postgres {
    /// The URL of its `postgres` database, for the managers' `database`.
    pub url: String,
    /// Held until dropped: closing it stops the server.
    stdin: Option<ChildStdin>,
    script: Child,
}

impl Postgres {
    /// Starts a server, failing with what to install when PostgreSQL is missing.
    pub fn start() -> anyhow::Result<Self> {
        let bin = binaries()?;
        let mut script = Command::new("sh")
            .arg("-c")
            .arg(SCRIPT)
            .arg("ongrid-e2e-postgres")
            .arg(&bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("running sh to start PostgreSQL")?;
        let stdin = script.stdin.take().context("the script's stdin")?;
        let stdout = script.stdout.take().context("the script's stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("reading the PostgreSQL start script")?;
        let Some(dir) = line.trim().strip_prefix("ready ") else {
            let _ = script.kill();
            let _ = script.wait();
            bail!(
                "starting PostgreSQL from {}: {}",
                bin.display(),
                line.trim()
            );
        };
        Ok(Self {
            url: format!("postgres://postgres@localhost/postgres?host={dir}"),
            stdin: Some(stdin),
            script,
        })
    }
}

impl Drop for Postgres {
    /// Closes the script's input and waits for it to stop the server (`pg_ctl stop -m
    /// immediate`), so no server outlives the test.
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.script.wait();
    }
}

/// The directory of `initdb` and `pg_ctl`: the newest `/usr/lib/postgresql/<version>/bin`.
fn binaries() -> anyhow::Result<PathBuf> {
    const INSTALL: &str = "install Debian's PostgreSQL (apt-get install postgresql; listed in \
                           deploy/debian-packages.txt with the tests tag)";
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .with_context(|| format!("/usr/lib/postgresql: {INSTALL}"))?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()).then_some((version, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => Ok(bin),
        None => bail!("no initdb and pg_ctl under /usr/lib/postgresql/*/bin: {INSTALL}"),
    }
}
