//! A real PostgreSQL server for the store tests: Debian's `postgresql` binaries
//! (`/usr/lib/postgresql/*/bin`), a cluster made with `initdb` in a temporary directory, listening
//! on a Unix socket in that directory only, run as the `postgres` user when the tests run as
//! root (PostgreSQL refuses root), else as the tests' user.
//! One server per test binary, started by the first test that asks; every test gets a database
//! of its own ([`fresh_database`]).
//!
//! The server is started and stopped by a small shell script that reads its standard input until
//! it closes: the test binary holds the other end, so when the binary exits (passed, failed or
//! killed) the script stops the server (`pg_ctl stop -m immediate`) and removes the directory.
//! Without the binaries the tests fail saying what to install.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use sqlx::Connection;

/// The script (`test_postgres.sh`): `$1` is the directory of initdb and pg_ctl. It prints
/// `ready <socket dir>` once the server accepts connections, or `failed: <why>`.
const SCRIPT: &str = include_str!("test_postgres.sh");

/// What to do when PostgreSQL is missing.
const INSTALL: &str = "the store tests run every test against a real PostgreSQL server too: \
     install Debian's PostgreSQL (apt-get install postgresql; listed in \
     deploy/debian-packages.txt with the tests tag)";

struct Server {
    socket_dir: String,
    /// Held until the test binary exits: closing it stops the server.
    _stdin: ChildStdin,
    _script: Child,
}

static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();

/// The directory of `initdb` and `pg_ctl`: the newest `/usr/lib/postgresql/<version>/bin`.
pub(crate) fn binaries() -> Result<PathBuf, String> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("/usr/lib/postgresql: {e}: {INSTALL}"))?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()).then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| format!("no initdb and pg_ctl under /usr/lib/postgresql/*/bin: {INSTALL}"))
}

fn start() -> Result<Server, String> {
    let bin = binaries()?;
    let mut script = Command::new("sh")
        .arg("-c")
        .arg(SCRIPT)
        .arg("ongrid-test-postgres")
        .arg(&bin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("running sh to start PostgreSQL: {e}"))?;
    let stdin = script.stdin.take().ok_or("no stdin")?;
    let stdout = script.stdout.take().ok_or("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| format!("reading the PostgreSQL start script: {e}"))?;
    match line.trim().strip_prefix("ready ") {
        Some(dir) => Ok(Server {
            socket_dir: dir.to_owned(),
            _stdin: stdin,
            _script: script,
        }),
        None => Err(format!(
            "starting PostgreSQL from {}: {}",
            bin.display(),
            if line.is_empty() {
                "the start script ended without a word"
            } else {
                line.trim()
            }
        )),
    }
}

fn server() -> &'static Server {
    match SERVER.get_or_init(start) {
        Ok(server) => server,
        Err(e) => panic!("PostgreSQL for the store tests: {e}"),
    }
}

fn url(socket_dir: &str, database: &str) -> String {
    format!("postgres://postgres@localhost/{database}?host={socket_dir}")
}

/// Makes an empty database on the test server and returns its URL.
pub(crate) async fn fresh_database() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let server = server();
    let name = format!(
        "store_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let mut admin = sqlx::PgConnection::connect(&url(&server.socket_dir, "postgres"))
        .await
        .unwrap_or_else(|e| panic!("connecting to the test PostgreSQL: {e}"));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
    admin.close().await.ok();
    url(&server.socket_dir, &name)
}
