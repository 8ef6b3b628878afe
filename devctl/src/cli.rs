//! devctl's command line, parsed by clap straight into ongrid-core's types (`SessionName`,
//! `ComputeCapability`, `MemorySize`, `Sharing`, `GpuMode`, `GpuUuid`, `Dn`, `HumanDuration`,
//! `Cidr`, `InstituteName`), so bad input is refused with core's message, and exit code 2,
//! before any request is made.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use chrono::{DateTime, NaiveDate, Utc};
use clap::{Args, Parser, Subcommand};
use ongrid_core::{
    Cidr, ComputeCapability, Dn, GpuMode, GpuRequest, GpuUuid, HumanDuration, InstituteName,
    MemorySize, SessionName, Sharing,
};

use crate::config::Overrides;

const AFTER_HELP: &str = "\
Settings, strongest first: flags, then environment variables, then the config file
~/.config/ongrid/devctl.toml (keys manager_url, cert, key, ca_dir), then the grid defaults.

Environment:
  ONGRID_MANAGER_URL    the manager, like https://manager.example.org:8443
  ONGRID_DEVCTL_CONFIG  another config file
  X509_USER_CERT        certificate (PEM), with X509_USER_KEY for its key
  X509_USER_PROXY       grid proxy (certificate and key in one file);
                        default /tmp/x509up_u<uid>, as voms-proxy-init writes it
  X509_CERT_DIR         trusted CAs (<hash>.0 or *.pem files);
                        default /etc/grid-security/certificates";

/// devctl: develop on the grid's GPUs.
///
/// Ask the site's ongrid manager for an interactive development session on a GPU, see where it
/// runs, and remove it when done. devctl authenticates with your grid certificate or proxy.
#[derive(Debug, Parser)]
#[command(name = "devctl", version, after_help = AFTER_HELP)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Settings that override the environment and the config file.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Config file [default: ~/.config/ongrid/devctl.toml, or $ONGRID_DEVCTL_CONFIG]
    #[arg(long, global = true, help_heading = "Settings", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The manager's URL [default: $ONGRID_MANAGER_URL, or manager_url in the config file]
    #[arg(long, global = true, help_heading = "Settings", value_name = "URL")]
    pub manager_url: Option<String>,
    /// Certificate or proxy file (PEM) [default: $X509_USER_CERT, $X509_USER_PROXY, cert in the
    /// config file, /tmp/x509up_u$UID]
    #[arg(long, global = true, help_heading = "Settings", value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// Private key of --cert, when it is not in the same file
    #[arg(
        long,
        global = true,
        help_heading = "Settings",
        value_name = "FILE",
        requires = "cert"
    )]
    pub key: Option<PathBuf>,
    /// Directory of trusted CA certificates [default: $X509_CERT_DIR, ca_dir in the config
    /// file, /etc/grid-security/certificates]
    #[arg(long, global = true, help_heading = "Settings", value_name = "DIR")]
    pub ca_dir: Option<PathBuf>,
}

impl GlobalArgs {
    pub fn overrides(&self) -> Overrides {
        Overrides {
            config: self.config.clone(),
            manager_url: self.manager_url.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
            ca_dir: self.ca_dir.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show who the manager takes you for: DN, login name, uid, admin, and your credential:
    /// certificate or proxy (impersonation, limited, independent), VO and FQANs, time left
    Whoami(JsonArgs),
    /// Create, list, show and remove development sessions
    #[command(subcommand)]
    Session(SessionCommand),
    /// List the site's nodes and GPUs: model, capability, memory, mode, use, health
    Gpus(JsonArgs),
    /// Register, list and remove the SSH public keys that reach your sessions
    ///
    /// A key is bound to the identity of your certificate or proxy and expires with it: after a
    /// new proxy, run devctl key add again.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Freeze a session into an immutable Apptainer SIF image and a matching Docker image
    ///
    /// The session keeps running (Docker pauses it briefly to take a snapshot). What only
    /// interactive use needs (host keys, shell history, caches, ongrid's tools) is left out.
    /// Files in your home directory (a volume) are not part of the image: copy what the image
    /// needs elsewhere, e.g. under /opt, before freezing.
    Freeze(crate::images::FreezeArgs),
    /// List, show and remove your frozen images
    #[command(subcommand)]
    Image(crate::images::ImageCommand),
    /// Site administration (admins only)
    #[command(subcommand)]
    Admin(AdminCommand),
}

#[derive(Debug, Clone, Args)]
pub struct JsonArgs {
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Ask for a new session on GPUs that meet your requirements
    ///
    /// The session is queued (PENDING) until a matching GPU is free, then started. A request
    /// that no GPU in the site could ever satisfy is refused, naming the requirement.
    New(NewArgs),
    /// List your sessions
    #[command(alias = "list")]
    Ls(LsArgs),
    /// Show a session: state, node, GPUs, and every transition with its reason
    Show(ShowArgs),
    /// Remove a session: its container is stopped and removed, its GPUs freed
    #[command(alias = "remove")]
    Rm(RmArgs),
    /// Put a session on hold: its container stops, its GPUs are freed for others, its files
    /// (the container's and your home directory) are kept until `devctl session release`
    Hold(HoldArgs),
    /// Bring a HELD session back: it restarts in the same container on the same node as soon as
    /// a fitting GPU is free there, and waits PENDING (with its queue position) until then
    Release(ReleaseArgs),
    /// Keep a session from being held as idle (or for want of a connection) for a while, e.g.
    /// while a job runs with its output going nowhere; the site caps how long
    Keep(KeepArgs),
}

#[derive(Debug, Clone, Args)]
pub struct HoldArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN (admins only; give a --reason)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    /// Why, shown to the session's owner (admins holding someone else's session)
    #[arg(long, requires = "owner")]
    pub reason: Option<String>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ReleaseArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct KeepArgs {
    /// The session's name
    pub name: SessionName,
    /// How long from now, like 4h, 90m or "2 hours"
    #[arg(long = "for", value_name = "DURATION")]
    pub duration: HumanDuration,
    /// Another user's session, by DN (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct NewArgs {
    /// Session name, also the SSH user name that reaches it: lower-case letters, digits and
    /// '-' [default: dev, dev-2, ...]
    #[arg(long)]
    pub name: Option<SessionName>,
    /// How many GPUs, all on one node
    #[arg(long, default_value = "1", value_parser = parse_gpu_count)]
    pub gpus: u32,
    /// Lowest CUDA compute capability to accept, like 8.0
    #[arg(long, value_name = "X.Y")]
    pub min_capability: Option<ComputeCapability>,
    /// Least memory per GPU, like 40G (10^9 bytes, as GPUs are sold) or 40GiB
    #[arg(long, value_name = "SIZE")]
    pub min_gpu_memory: Option<MemorySize>,
    /// Whole GPUs only (exclusive), shares of shared GPUs only (shared), or either (any)
    #[arg(long, default_value = "exclusive", value_name = "exclusive|shared|any")]
    pub share: Sharing,
    /// Docker image of the dev container [default: the site's]
    #[arg(long, value_name = "IMAGE", value_parser = parse_image)]
    pub image: Option<String>,
    /// Wait until the session runs (WAITING for your connection), then print it
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits, like 5m, 90s or "2 hours"
    #[arg(long, default_value = "5m", requires = "wait", value_name = "DURATION")]
    pub timeout: HumanDuration,
    /// Hold the session after this long without a connection or activity, like 2h
    /// [default: the site's; at most the site's maximum]
    #[arg(long, value_name = "DURATION")]
    pub idle_timeout: Option<HumanDuration>,
    /// Hold the session this long after it first started, whatever happens, like 3d
    /// [default: the site's; at most the site's maximum]
    #[arg(long, value_name = "DURATION")]
    pub max_duration: Option<HumanDuration>,
    #[command(flatten)]
    pub output: JsonArgs,
}

impl NewArgs {
    pub fn request(&self) -> GpuRequest {
        GpuRequest {
            count: self.gpus,
            min_capability: self.min_capability,
            min_memory: self.min_gpu_memory,
            sharing: self.share,
        }
    }
}

/// A GPU count, checked by the same rule the manager applies.
fn parse_gpu_count(value: &str) -> Result<u32, String> {
    let count: u32 = value
        .trim()
        .parse()
        .map_err(|_| format!("GPU count {value:?} must be a whole number like 1 or 2"))?;
    let request = GpuRequest {
        count,
        ..GpuRequest::default()
    };
    request.validate().map_err(|err| err.to_string())?;
    Ok(count)
}

fn parse_image(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() || value.contains(char::is_whitespace) {
        return Err(format!(
            "image {value:?} must be a Docker image reference like ongrid/dev:latest"
        ));
    }
    Ok(value.to_owned())
}

#[derive(Debug, Clone, Args)]
pub struct LsArgs {
    /// Everybody's sessions (admins only)
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN like "/DC=org/DC=example/CN=Alice Smith" (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct RmArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Register an SSH public key for your identity, until your certificate expires
    ///
    /// Adding a key that is already yours renews its expiry to your current certificate's.
    Add(KeyAddArgs),
    /// List your SSH keys with their fingerprints and expiry
    #[command(alias = "list")]
    Ls(KeyLsArgs),
    /// Remove an SSH key by its fingerprint, as devctl key ls shows it
    #[command(alias = "remove")]
    Rm(KeyRmArgs),
}

#[derive(Debug, Clone, Args)]
pub struct KeyAddArgs {
    /// The public key file [default: ~/.ssh/id_ed25519.pub, else ~/.ssh/id_ecdsa.pub, else
    /// ~/.ssh/id_rsa.pub]
    #[arg(value_name = "PUBKEY_FILE")]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct KeyLsArgs {
    /// Everybody's keys (admins only)
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct KeyRmArgs {
    /// The key's fingerprint, like SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI
    pub fingerprint: Fingerprint,
    #[command(flatten)]
    pub output: JsonArgs,
}

/// An SSH key fingerprint as `ssh-keygen -l` prints it: `SHA256:` and 43 base64 characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(String);

impl Fingerprint {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Fingerprint {
    type Err = String;
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let problem = || {
            format!(
                "fingerprint {value:?} must look like SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI, \
                 as devctl key ls shows it"
            )
        };
        let hash = value
            .trim()
            .strip_prefix("SHA256:")
            .ok_or_else(problem)?
            // ssh-keygen leaves out base64's padding; accept a pasted one.
            .trim_end_matches('=');
        let base64 = |b: u8| b.is_ascii_alphanumeric() || b == b'+' || b == b'/';
        if hash.len() != 43 || !hash.bytes().all(base64) {
            return Err(problem());
        }
        Ok(Self(format!("SHA256:{hash}")))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Manage GPUs
    #[command(subcommand)]
    Gpu(AdminGpuCommand),
    /// Manage the institutes whose networks may reach the SSH gateway
    #[command(subcommand)]
    Institute(InstituteCommand),
    /// List SSH connections to sessions: who, from where, with which key, how much
    Audit(AuditArgs),
}

#[derive(Debug, Subcommand)]
pub enum InstituteCommand {
    /// Allow an institute's networks: the gateway accepts connections from them
    Add(InstituteAddArgs),
    /// Remove an institute: its networks are no longer allowed
    #[command(alias = "remove")]
    Rm(InstituteNameArgs),
    /// List the allowed institutes and their networks
    #[command(alias = "list")]
    Ls(JsonArgs),
    /// Show one institute's networks
    Show(InstituteNameArgs),
}

#[derive(Debug, Clone, Args)]
pub struct InstituteAddArgs {
    /// The institute's name: lower-case letters, digits, '-', '_' and '.', like uni-glasgow
    pub name: InstituteName,
    /// Its networks, like 192.0.2.0/24 or 2001:db8::/32 (a bare address is one host)
    #[arg(required = true, value_name = "CIDR")]
    pub cidrs: Vec<Cidr>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct InstituteNameArgs {
    /// The institute's name
    pub name: InstituteName,
    #[command(flatten)]
    pub output: JsonArgs,
}

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

#[derive(Debug, Subcommand)]
pub enum AdminGpuCommand {
    /// Set how sessions may use a GPU: exclusive (one session) or shared:N (up to N)
    Mode(GpuModeArgs),
}

#[derive(Debug, Clone, Args)]
pub struct GpuModeArgs {
    /// The GPU's UUID, as devctl gpus --json shows it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    pub gpu: GpuUuid,
    /// exclusive, or shared:N with N from 2 to 64
    #[arg(value_name = "exclusive|shared:N")]
    pub mode: GpuMode,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("devctl").chain(args.iter().copied()))
    }

    fn refused(args: &[&str]) -> String {
        let err = parse(args).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{err}");
        err.to_string()
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn session_new_parses_into_a_request() {
        let cli = parse(&[
            "session",
            "new",
            "--name",
            "train1",
            "--gpus",
            "2",
            "--min-capability",
            "8.0",
            "--min-gpu-memory",
            "40G",
            "--share",
            "any",
            "--image",
            "ongrid/dev:latest",
            "--wait",
            "--timeout",
            "10 minutes",
            "--json",
        ])
        .unwrap();
        let Command::Session(SessionCommand::New(new)) = cli.command else {
            panic!("not session new: {cli:?}");
        };
        assert_eq!(new.name.as_ref().unwrap().as_str(), "train1");
        let request = new.request();
        assert_eq!(request.count, 2);
        assert_eq!(request.min_capability, Some(ComputeCapability::new(8, 0)));
        assert_eq!(request.min_memory, Some(MemorySize(40_000_000_000)));
        assert_eq!(request.sharing, Sharing::Any);
        assert_eq!(new.image.as_deref(), Some("ongrid/dev:latest"));
        assert!(new.wait);
        assert_eq!(new.timeout, HumanDuration::from_secs(600));
        assert!(new.output.json);
    }

    #[test]
    fn session_new_defaults() {
        let cli = parse(&["session", "new"]).unwrap();
        let Command::Session(SessionCommand::New(new)) = cli.command else {
            panic!("not session new");
        };
        assert_eq!(new.name, None);
        assert_eq!(new.request(), GpuRequest::default());
        assert!(!new.wait);
        assert_eq!(new.timeout, HumanDuration::from_secs(300));
    }

    #[test]
    fn bad_values_are_refused_with_the_core_message() {
        let msg = refused(&["session", "new", "--name", "My Session"]);
        assert!(
            msg.contains(
                "session name \"My Session\" may only contain lower-case letters, digits and '-'"
            ),
            "{msg}"
        );
        let msg = refused(&["session", "new", "--min-capability", "eight"]);
        assert!(
            msg.contains("compute capability \"eight\" must look like 8.0 (major.minor)"),
            "{msg}"
        );
        let msg = refused(&["session", "new", "--min-gpu-memory", "40X"]);
        assert!(
            msg.contains("memory size \"40X\" has unknown unit \"X\""),
            "{msg}"
        );
        let msg = refused(&["session", "new", "--gpus", "0"]);
        assert!(msg.contains("a session needs at least 1 GPU"), "{msg}");
        let msg = refused(&["session", "new", "--gpus", "65"]);
        assert!(msg.contains("more than the limit of 64"), "{msg}");
        let msg = refused(&["session", "new", "--share", "half"]);
        assert!(
            msg.contains("sharing \"half\" must be one of exclusive, shared, any"),
            "{msg}"
        );
        let msg = refused(&["session", "new", "--wait", "--timeout", "soon"]);
        assert!(msg.contains("duration \"soon\""), "{msg}");
        let msg = refused(&["session", "show", "train1", "--owner", "CN=Alice"]);
        assert!(msg.contains("must be in slash form"), "{msg}");
        let msg = refused(&["session", "rm", "bad-"]);
        assert!(
            msg.contains("must start and end with a letter or digit"),
            "{msg}"
        );
        let msg = refused(&["admin", "gpu", "mode", "0", "exclusive"]);
        assert!(msg.contains("GPU UUID \"0\" must look like GPU-"), "{msg}");
        let msg = refused(&[
            "admin",
            "gpu",
            "mode",
            "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f",
            "shared:1",
        ]);
        assert!(msg.contains("N from 2 to 64"), "{msg}");
    }

    #[test]
    fn timeout_needs_wait() {
        let err = parse(&["session", "new", "--timeout", "5m"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument, "{err}");
    }

    #[test]
    fn key_needs_cert() {
        let err = parse(&["--key", "/k.pem", "gpus"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument, "{err}");
        assert!(parse(&["gpus", "--cert", "/c.pem", "--key", "/k.pem"]).is_ok());
    }

    #[test]
    fn global_flags_go_before_or_after_the_command() {
        let cli = parse(&["--manager-url", "https://m", "session", "ls", "--all"]).unwrap();
        assert_eq!(cli.global.manager_url.as_deref(), Some("https://m"));
        let cli = parse(&["session", "ls", "--ca-dir", "/cas", "--json"]).unwrap();
        assert_eq!(cli.global.ca_dir, Some(PathBuf::from("/cas")));
        let Command::Session(SessionCommand::Ls(ls)) = cli.command else {
            panic!("not session ls");
        };
        assert!(ls.output.json && !ls.all);
    }

    #[test]
    fn show_rm_and_admin_parse() {
        let cli = parse(&[
            "session",
            "show",
            "train1",
            "--owner",
            "/DC=org/DC=example/CN=Alice Smith",
        ])
        .unwrap();
        let Command::Session(SessionCommand::Show(show)) = cli.command else {
            panic!("not session show");
        };
        assert_eq!(
            show.owner.unwrap().as_str(),
            "/DC=org/DC=example/CN=Alice Smith"
        );
        let cli = parse(&[
            "admin",
            "gpu",
            "mode",
            "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f",
            "shared:4",
        ])
        .unwrap();
        let Command::Admin(AdminCommand::Gpu(AdminGpuCommand::Mode(mode))) = cli.command else {
            panic!("not admin gpu mode");
        };
        assert_eq!(mode.mode, GpuMode::Shared { max_sessions: 4 });
        assert!(parse(&["session", "list"]).is_ok());
        assert!(parse(&["session", "remove", "train1"]).is_ok());
        assert!(parse(&["whoami", "--json"]).is_ok());
    }

    #[test]
    fn key_commands_parse() {
        let cli = parse(&["key", "add"]).unwrap();
        let Command::Key(KeyCommand::Add(add)) = cli.command else {
            panic!("not key add");
        };
        assert_eq!(add.file, None);
        let cli = parse(&["key", "add", "/tmp/k.pub", "--json"]).unwrap();
        let Command::Key(KeyCommand::Add(add)) = cli.command else {
            panic!("not key add");
        };
        assert_eq!(add.file, Some(PathBuf::from("/tmp/k.pub")));
        assert!(add.output.json);
        let cli = parse(&["key", "ls", "--all", "--json"]).unwrap();
        let Command::Key(KeyCommand::Ls(ls)) = cli.command else {
            panic!("not key ls");
        };
        assert!(ls.all && ls.output.json);
        let cli = parse(&[
            "key",
            "rm",
            "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI=",
        ])
        .unwrap();
        let Command::Key(KeyCommand::Rm(rm)) = cli.command else {
            panic!("not key rm");
        };
        assert_eq!(
            rm.fingerprint.as_str(),
            "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI",
            "padding is dropped"
        );
    }

    #[test]
    fn bad_fingerprints_are_refused() {
        for bad in [
            "JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI",
            "MD5:16:27:ac:a5:76:28:2d:36:63:1b:56:4d:eb:df:a6:48",
            "SHA256:short",
            "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hF!I",
        ] {
            let msg = refused(&["key", "rm", bad]);
            assert!(
                msg.contains("must look like SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI, as devctl key ls shows it"),
                "{bad}: {msg}"
            );
        }
        let err = parse(&["key", "rm"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument, "{err}");
    }

    #[test]
    fn institute_commands_parse_into_core_types() {
        let cli = parse(&[
            "admin",
            "institute",
            "add",
            "uni-glasgow",
            "130.209.0.0/16",
            "2001:630:40::/48",
            "192.0.2.7",
        ])
        .unwrap();
        let Command::Admin(AdminCommand::Institute(InstituteCommand::Add(add))) = cli.command
        else {
            panic!("not admin institute add");
        };
        assert_eq!(add.name.as_str(), "uni-glasgow");
        let cidrs: Vec<String> = add.cidrs.iter().map(ToString::to_string).collect();
        assert_eq!(
            cidrs,
            ["130.209.0.0/16", "2001:630:40::/48", "192.0.2.7/32"]
        );
        for args in [
            &["admin", "institute", "rm", "local"][..],
            &["admin", "institute", "remove", "local"],
            &["admin", "institute", "ls", "--json"],
            &["admin", "institute", "list"],
            &["admin", "institute", "show", "local", "--json"],
        ] {
            assert!(parse(args).is_ok(), "{args:?}");
        }
    }

    #[test]
    fn bad_institutes_are_refused_with_the_core_message() {
        let msg = refused(&["admin", "institute", "add", "local", "10.1.2.3/16"]);
        assert!(
            msg.contains("\"10.1.2.3/16\" has host bits set: the network is 10.1.0.0/16"),
            "{msg}"
        );
        let msg = refused(&["admin", "institute", "add", "local", "10.0.0.0/33"]);
        assert!(msg.contains("prefix length 33, more than 32"), "{msg}");
        let msg = refused(&["admin", "institute", "add", "Uni Glasgow", "10.0.0.0/8"]);
        assert!(
            msg.contains("institute name \"Uni Glasgow\" must be 1 to 64 lower-case letters"),
            "{msg}"
        );
        let err = parse(&["admin", "institute", "add", "local"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument, "{err}");
        let msg = refused(&["admin", "institute", "show", "Local"]);
        assert!(msg.contains("institute name \"Local\" must be"), "{msg}");
    }

    #[test]
    fn audit_since_takes_a_time_or_a_duration() {
        let cli = parse(&[
            "admin",
            "audit",
            "--user",
            "/DC=org/DC=example/CN=Alice Smith",
            "--since",
            "2h",
            "--json",
        ])
        .unwrap();
        let Command::Admin(AdminCommand::Audit(audit)) = cli.command else {
            panic!("not admin audit");
        };
        assert_eq!(
            audit.user.unwrap().as_str(),
            "/DC=org/DC=example/CN=Alice Smith"
        );
        assert_eq!(
            audit.since,
            Some(Since::Ago(HumanDuration::from_secs(7200)))
        );
        let now = DateTime::from_timestamp(1_795_255_200, 0).unwrap();
        assert_eq!(
            audit.since.unwrap().resolve(now),
            DateTime::from_timestamp(1_795_255_200 - 7200, 0).unwrap()
        );
        let at = |s: &str| s.parse::<Since>().unwrap().resolve(now);
        assert_eq!(at("2026-11-21T10:00:00Z"), now);
        assert_eq!(at("2026-11-21T11:00:00+01:00"), now);
        assert_eq!(at("2026-11-21 10:00:00Z"), now, "devctl's own format");
        assert_eq!(
            at("2026-11-21"),
            DateTime::from_timestamp(1_795_255_200 - 36_000, 0).unwrap()
        );
        assert_eq!(at("3 days"), now - chrono::Duration::days(3));
        assert_eq!(
            Since::Ago(HumanDuration::from_secs(u64::MAX)).resolve(now),
            DateTime::<Utc>::MIN_UTC
        );
        let msg = refused(&["admin", "audit", "--since", "yesterday"]);
        assert!(
            msg.contains("\"yesterday\" must be a time like 2026-11-21T10:00:00Z or 2026-11-21"),
            "{msg}"
        );
        let msg = refused(&["admin", "audit", "--user", "Alice"]);
        assert!(msg.contains("must be in slash form"), "{msg}");
    }
}
