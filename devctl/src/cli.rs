//! devctl's command line: the global settings flags and the commands, each of whose arguments
//! are defined by its feature module (`session`, `key`, `image`, `admin`, ...). clap parses
//! them straight into ongrid-core's types (`SessionName`, `ComputeCapability`, `MemorySize`,
//! `Sharing`, `GpuMode`, `GpuUuid`, `Dn`, `HumanDuration`, `Cidr`, `InstituteName`), so bad
//! input is refused with core's message, and exit code 2, before any request is made.
//! [`Command::run`] hands each command to its module.

use std::path::{Path, PathBuf};

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::admin::{self, AdminCommand};
use crate::client::Client;
use crate::config::Overrides;
use crate::image::freeze::FreezeArgs;
use crate::image::{self, ImageCommand};
use crate::job::{self, JobCommand};
use crate::key::{self, KeyCommand};
use crate::manual::{self, CompletionsArgs, ManpagesArgs};
use crate::session::{self, SessionCommand};
use crate::terminal::{JsonArgs, Terminal};
use crate::{dashboard, gpu, share, whoami};

const AFTER_HELP: &str = "\
Settings, strongest first: flags, then environment variables, then the config file
~/.config/ongrid/devctl.toml (keys manager_url, cert, key, ca_dir), then the grid defaults.

Credential: a bearer token if one is found (WLCG Bearer Token Discovery: BEARER_TOKEN, then
BEARER_TOKEN_FILE, then $XDG_RUNTIME_DIR/bt_u<uid>, then /tmp/bt_u<uid>), unless --cert is
given; else the certificate or proxy. Get a token with oidc-agent
(oidc-token ACCOUNT > $XDG_RUNTIME_DIR/bt_u$(id -u)) or htgettoken.

Environment:
  ONGRID_MANAGER_URL    the manager, like https://manager.example.org:8443 (its replicas:
                        several, separated by commas)
  ONGRID_DEVCTL_CONFIG  another config file
  X509_USER_CERT        certificate (PEM), with X509_USER_KEY for its key
  X509_USER_PROXY       grid proxy (certificate and key in one file);
                        default /tmp/x509up_u<uid>, as voms-proxy-init writes it
  X509_CERT_DIR         trusted CAs (<hash>.0 or *.pem files);
                        default /etc/grid-security/certificates
  BEARER_TOKEN          a bearer token (JWT) itself
  BEARER_TOKEN_FILE     a file holding the bearer token (mode 0600)
  XDG_RUNTIME_DIR       where bt_u<uid> holds the bearer token";

/// devctl: develop on the grid's GPUs.
///
/// Ask the site's ongrid manager for an interactive development session on a GPU, see where it
/// runs, and remove it when done. devctl authenticates with your bearer token (WLCG, SciTokens)
/// when it finds one, else with your grid certificate or proxy.
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
    /// The manager's URL, or its replicas' separated by commas [default: $ONGRID_MANAGER_URL, or
    /// manager_url in the config file]
    #[arg(long, global = true, help_heading = "Settings", value_name = "URL")]
    pub manager_url: Option<String>,
    /// Certificate or proxy file (PEM); given, devctl uses it even when it finds a bearer token
    /// [default: a bearer token if found, else $X509_USER_CERT, $X509_USER_PROXY, cert in the
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
    /// certificate or proxy (impersonation, limited, independent), VO and FQANs, or bearer
    /// token (where devctl found it, issuer, subject, groups, scopes), time left
    Whoami(JsonArgs),
    /// Create, list, show and remove development sessions
    #[command(subcommand)]
    Session(SessionCommand),
    /// List the site's nodes and GPUs: model, capability, memory, mode, use, health
    Gpus(JsonArgs),
    /// Register, list and remove the SSH public keys that reach your sessions
    ///
    /// A key is bound to the identity of your certificate, proxy or bearer token and expires with
    /// it: after a new proxy or token, run devctl key add again.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Freeze a session into an immutable Apptainer SIF image and a matching Docker image
    ///
    /// The session keeps running (Docker pauses it briefly to take a snapshot). What only
    /// interactive use needs (host keys, shell history, caches, ongrid's tools) is left out.
    /// Files in your home directory (a volume) are not part of the image: copy what the image
    /// needs elsewhere, e.g. under /opt, before freezing.
    Freeze(FreezeArgs),
    /// List, show and remove your frozen images
    #[command(subcommand)]
    Image(ImageCommand),
    /// Run frozen images as batch jobs on the site's GPUs: submit, ls, show, logs, cancel, halt
    #[command(subcommand)]
    Job(JobCommand),
    /// Show the site's fair share: each accounting group's share, cost-weighted GPU-hours
    /// (decayed) and priority factor, with your own usage (everyone's for admins)
    Share(JsonArgs),
    /// Site administration (admins only)
    #[command(subcommand)]
    Admin(AdminCommand),
    /// Print a login link to the manager's web dashboard (works once, for five minutes)
    ///
    /// Open it in your browser: it logs that browser in as you (your sessions, images and jobs;
    /// everything for admins) until the end of the working day or your credential, whichever
    /// is first.
    Dashboard(JsonArgs),
    /// Print the shell completion script for bash, zsh or fish
    ///
    /// Try it with `source <(devctl completions bash)`; keep it with
    /// `devctl completions bash > ~/.local/share/bash-completion/completions/devctl` (zsh: a file
    /// `_devctl` in a directory of $fpath; fish: ~/.config/fish/completions/devctl.fish). The
    /// packages install all three.
    Completions(CompletionsArgs),
    /// Write the man pages (devctl.1, devctl-session-new.1, ...) into a directory
    #[command(hide = true)]
    Manpages(ManpagesArgs),
}

impl Command {
    /// Runs the command: `connect` makes the client of those that talk to the manager (the
    /// completions and man pages need neither a manager nor a credential); `home` is where
    /// `key add` looks for `~/.ssh`.
    pub async fn run(
        self,
        connect: impl FnOnce() -> anyhow::Result<Client>,
        home: Option<&Path>,
        term: &mut Terminal<'_>,
    ) -> anyhow::Result<()> {
        match self {
            Self::Completions(args) => manual::completions(&args, Cli::command(), term),
            Self::Manpages(args) => manual::manpages(&args, Cli::command(), term),
            Self::Whoami(args) => whoami::run(args, &connect()?, term).await,
            Self::Session(command) => session::run(command, &connect()?, term).await,
            Self::Gpus(args) => gpu::run(args, &connect()?, term).await,
            Self::Key(command) => key::run(command, &connect()?, home, term).await,
            Self::Freeze(args) => image::freeze::run(args, &connect()?, term).await,
            Self::Image(command) => image::run(command, &connect()?, term).await,
            Self::Job(command) => job::run(command, &connect()?, term).await,
            Self::Share(args) => share::run(args, &connect()?, term).await,
            Self::Admin(command) => admin::run(command, &connect()?, term).await,
            Self::Dashboard(args) => dashboard::run(args, &connect()?, term).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::audit::Since;
    use crate::admin::gpu::AdminGpuCommand;
    use crate::admin::institute::InstituteCommand;
    use chrono::{DateTime, Utc};
    use clap::error::ErrorKind;
    use ongrid_core::{ComputeCapability, GpuMode, GpuRequest, HumanDuration, MemorySize, Sharing};

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
