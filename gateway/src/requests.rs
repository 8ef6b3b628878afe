//! Which channel requests the gateway grants, decided by the russh handler the moment each
//! request arrives, so its answer goes out then and in order.
//!
//! Why not later, from the channel's task: SSH pairs replies with requests only by order, and
//! a request sent with want-reply false (OpenSSH's `env`, always) must get none. russh's
//! handler callbacks do not show want-reply; russh keeps one flag per channel, set from the
//! request it read last, and `channel_success`/`channel_failure` send only while that flag is
//! set. Answered in the callback, the flag is the request's own. Answered later, through the
//! `Handle`, it is whichever request came last: an `env` refused after the client's `exec` was
//! read sent a failure that OpenSSH took for the `exec`'s ("exec request failed"), and a
//! reply could be lost the other way round. Every decision therefore depends only on the
//! requests before it, never on the agent: `shell`, `exec` and `subsystem sftp` are granted at
//! once, and a process the agent cannot start is reported on stderr with exit status 1 (after
//! a `failure` OpenSSH would discard that stderr anyway).
//!
//! Only granted requests reach the channel's task (plus `window-change` and `signal`, which
//! take no reply).

use ongrid_core::stream::env_allowed;

/// At most this many `env` requests are granted per channel.
pub const MAX_ENV: usize = 64;
pub const MAX_ENV_NAME: usize = 256;
pub const MAX_ENV_VALUE: usize = 4096;

/// A channel request. Those that may want a reply are answered by the handler as they arrive
/// ([`RequestGate::answer`]); only granted ones are queued (`input.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Pty {
        term: String,
        cols: u32,
        rows: u32,
    },
    Env {
        name: String,
        value: String,
    },
    Shell,
    Exec(Vec<u8>),
    Subsystem(String),
    X11,
    /// No reply.
    WindowChange {
        cols: u32,
        rows: u32,
    },
    /// No reply.
    Signal(String),
}

impl Request {
    /// The request's name in SSH.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Pty { .. } => "pty-req",
            Request::Env { .. } => "env",
            Request::Shell => "shell",
            Request::Exec(_) => "exec",
            Request::Subsystem(_) => "subsystem",
            Request::X11 => "x11-req",
            Request::WindowChange { .. } => "window-change",
            Request::Signal(_) => "signal",
        }
    }

    /// Whether the client may be waiting for a success or failure.
    pub fn may_want_reply(&self) -> bool {
        !matches!(self, Request::WindowChange { .. } | Request::Signal(_))
    }
}

/// The gateway's answer to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// `success` (when wanted), and the request goes to the channel's task.
    Grant,
    /// `failure` (when wanted); the channel's task never sees it.
    Refuse(Refused),
    /// A request that takes no reply (`window-change`, `signal`): to the channel's task.
    NoReply,
}

/// Why a request was refused (for the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// A TCP forward takes no requests.
    NotASession,
    /// The channel already runs its program: no new program, terminal or environment.
    AlreadyStarted,
    /// A second `pty-req`.
    SecondPty,
    /// A variable that is not passed on, too long, or one too many.
    Env,
    /// A subsystem other than `sftp`.
    Subsystem,
    /// X11 forwarding.
    X11,
}

/// What kind of channel the requests arrive on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelKind {
    Session,
    DirectTcpip,
}

/// The requests granted so far on one channel.
#[derive(Debug, Clone)]
pub struct RequestGate {
    kind: ChannelKind,
    pty: bool,
    env: usize,
    started: bool,
}

impl RequestGate {
    pub fn new(kind: ChannelKind) -> Self {
        Self {
            kind,
            pty: false,
            env: 0,
            started: false,
        }
    }

    /// Decides `request`, remembering what it grants.
    pub fn answer(&mut self, request: &Request) -> Answer {
        if !request.may_want_reply() {
            return Answer::NoReply;
        }
        if self.kind != ChannelKind::Session {
            return Answer::Refuse(Refused::NotASession);
        }
        if self.started {
            return Answer::Refuse(Refused::AlreadyStarted);
        }
        match request {
            Request::Pty { .. } if self.pty => Answer::Refuse(Refused::SecondPty),
            Request::Pty { .. } => {
                self.pty = true;
                Answer::Grant
            }
            Request::Env { name, value } => {
                let ok = env_allowed(name)
                    && self.env < MAX_ENV
                    && name.len() <= MAX_ENV_NAME
                    && value.len() <= MAX_ENV_VALUE;
                if !ok {
                    return Answer::Refuse(Refused::Env);
                }
                self.env += 1;
                Answer::Grant
            }
            Request::Subsystem(name) if name != "sftp" => Answer::Refuse(Refused::Subsystem),
            Request::Shell | Request::Exec(_) | Request::Subsystem(_) => {
                self.started = true;
                Answer::Grant
            }
            Request::X11 => Answer::Refuse(Refused::X11),
            Request::WindowChange { .. } | Request::Signal(_) => Answer::NoReply,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str, value: &str) -> Request {
        Request::Env {
            name: name.to_owned(),
            value: value.to_owned(),
        }
    }

    fn pty() -> Request {
        Request::Pty {
            term: "xterm".to_owned(),
            cols: 80,
            rows: 24,
        }
    }

    #[test]
    fn a_session_takes_one_terminal_allowed_variables_then_one_program() {
        let mut gate = RequestGate::new(ChannelKind::Session);
        assert_eq!(gate.answer(&pty()), Answer::Grant);
        assert_eq!(gate.answer(&pty()), Answer::Refuse(Refused::SecondPty));
        assert_eq!(gate.answer(&env("LANG", "C.UTF-8")), Answer::Grant);
        assert_eq!(
            gate.answer(&env("BASH_ENV", "/tmp/x")),
            Answer::Refuse(Refused::Env)
        );
        assert_eq!(
            gate.answer(&env("LC_ALL", &"x".repeat(MAX_ENV_VALUE + 1))),
            Answer::Refuse(Refused::Env)
        );
        assert_eq!(gate.answer(&Request::X11), Answer::Refuse(Refused::X11));
        assert_eq!(
            gate.answer(&Request::Subsystem("netconf".to_owned())),
            Answer::Refuse(Refused::Subsystem)
        );
        let resize = Request::WindowChange { cols: 1, rows: 1 };
        assert_eq!(gate.answer(&resize), Answer::NoReply);
        assert_eq!(gate.answer(&Request::Exec(b"ls".to_vec())), Answer::Grant);
        // Started: nothing more but resizes and signals.
        for request in [
            Request::Shell,
            Request::Exec(b"id".to_vec()),
            Request::Subsystem("sftp".to_owned()),
            pty(),
            env("LANG", "C"),
        ] {
            assert_eq!(
                gate.answer(&request),
                Answer::Refuse(Refused::AlreadyStarted),
                "{request:?}"
            );
        }
        assert_eq!(gate.answer(&resize), Answer::NoReply);
        assert_eq!(
            gate.answer(&Request::Signal("INT".to_owned())),
            Answer::NoReply
        );
    }

    #[test]
    fn sftp_and_shells_start_a_session() {
        let mut gate = RequestGate::new(ChannelKind::Session);
        assert_eq!(
            gate.answer(&Request::Subsystem("sftp".to_owned())),
            Answer::Grant
        );
        assert_eq!(
            gate.answer(&Request::Shell),
            Answer::Refuse(Refused::AlreadyStarted)
        );
        let mut gate = RequestGate::new(ChannelKind::Session);
        assert_eq!(gate.answer(&Request::Shell), Answer::Grant);
    }

    #[test]
    fn the_number_of_variables_is_bounded() {
        let mut gate = RequestGate::new(ChannelKind::Session);
        for _ in 0..MAX_ENV {
            assert_eq!(gate.answer(&env("LC_PAPER", "C")), Answer::Grant);
        }
        assert_eq!(
            gate.answer(&env("LC_PAPER", "C")),
            Answer::Refuse(Refused::Env)
        );
    }

    #[test]
    fn a_forward_takes_no_requests() {
        let mut gate = RequestGate::new(ChannelKind::DirectTcpip);
        assert_eq!(
            gate.answer(&Request::Shell),
            Answer::Refuse(Refused::NotASession)
        );
        assert_eq!(
            gate.answer(&Request::Signal("TERM".to_owned())),
            Answer::NoReply
        );
    }
}
