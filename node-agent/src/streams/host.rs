//! What the stream endpoint does on the node itself rather than through Docker, because Docker
//! has no API for it: sending a signal to a process of a container (there is no exec-kill API),
//! and opening a TCP connection inside a container's network namespace. Both need the agent to
//! run as root in the host's PID namespace, as it does on a node.

use std::fs::File;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{getpgid, Pid};

/// Why a signal was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("process {pid} is not in the container (its PID namespace differs): not signalled")]
    NotInContainer { pid: u32 },
    #[error("reading the namespaces of process {pid}")]
    Namespace {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("sending {signal} to process {pid}")]
    Kill {
        pid: u32,
        signal: Signal,
        #[source]
        source: nix::Error,
    },
}

/// The signal an SSH `signal` request names (RFC 4254 §6.10, without `SIG`); `None` for names
/// SSH does not define, which are ignored as OpenSSH's sshd ignores them.
pub fn signal_by_ssh_name(name: &str) -> Option<Signal> {
    Some(match name {
        "ABRT" => Signal::SIGABRT,
        "ALRM" => Signal::SIGALRM,
        "FPE" => Signal::SIGFPE,
        "HUP" => Signal::SIGHUP,
        "ILL" => Signal::SIGILL,
        "INT" => Signal::SIGINT,
        "KILL" => Signal::SIGKILL,
        "PIPE" => Signal::SIGPIPE,
        "QUIT" => Signal::SIGQUIT,
        "SEGV" => Signal::SIGSEGV,
        "TERM" => Signal::SIGTERM,
        "USR1" => Signal::SIGUSR1,
        "USR2" => Signal::SIGUSR2,
        _ => return None,
    })
}

/// Sends `signal` to the process with host PID `pid`, which must be in the same PID namespace as
/// the container's first process `container_pid` (so a PID reused by a host process after the
/// exec ended is never signalled). Like sshd, which signals the session's process group, the
/// whole group gets it when the process leads one (Docker starts every exec in a new session).
pub fn signal_process(pid: u32, container_pid: u32, signal: Signal) -> Result<(), SignalError> {
    if pid_namespace(pid)? != pid_namespace(container_pid)? {
        return Err(SignalError::NotInContainer { pid });
    }
    let target =
        Pid::from_raw(i32::try_from(pid).map_err(|_| SignalError::NotInContainer { pid })?);
    let result = match getpgid(Some(target)) {
        Ok(group) if group == target => killpg(group, signal),
        _ => kill(target, signal),
    };
    result.map_err(|source| SignalError::Kill {
        pid,
        signal,
        source,
    })
}

fn pid_namespace(pid: u32) -> Result<std::path::PathBuf, SignalError> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .map_err(|source| SignalError::Namespace { pid, source })
}

/// Connects to `port` on the first of `addresses` that answers, from inside the network
/// namespace of process `pid` (a container's first process), so that the container's own
/// loopback is reached. The connection is made on a thread of its own that enters the namespace
/// and then ends; the socket stays in the container's namespace and is handed to tokio.
pub async fn connect_in_netns(
    pid: u32,
    addresses: Vec<IpAddr>,
    port: u16,
    timeout: Duration,
) -> io::Result<tokio::net::TcpStream> {
    let (sender, receiver) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("ongrid-netns-{pid}"))
        .spawn(move || {
            let _ = sender.send(connect_blocking(pid, &addresses, port, timeout));
        })?;
    let stream = receiver
        .await
        .map_err(|_| io::Error::other("the connecting thread ended without an answer"))??;
    stream.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(stream)
}

/// Runs on a thread that is thrown away afterwards: `setns` changes the calling thread's network
/// namespace for good.
fn connect_blocking(
    pid: u32,
    addresses: &[IpAddr],
    port: u16,
    timeout: Duration,
) -> io::Result<std::net::TcpStream> {
    let namespace = File::open(format!("/proc/{pid}/ns/net"))?;
    setns(&namespace, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
    // The first address's error is the one reported: `localhost` is 127.0.0.1 first, and a
    // container without IPv6 would otherwise answer "cannot assign requested address" for ::1.
    let mut first_error = None;
    for address in addresses {
        match std::net::TcpStream::connect_timeout(&SocketAddr::new(*address, port), timeout) {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error
        .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn ssh_signal_names_map_to_signals() {
        assert_eq!(signal_by_ssh_name("INT"), Some(Signal::SIGINT));
        assert_eq!(signal_by_ssh_name("TERM"), Some(Signal::SIGTERM));
        assert_eq!(signal_by_ssh_name("HUP"), Some(Signal::SIGHUP));
        assert_eq!(signal_by_ssh_name("KILL"), Some(Signal::SIGKILL));
        assert_eq!(signal_by_ssh_name("QUIT"), Some(Signal::SIGQUIT));
        assert_eq!(signal_by_ssh_name("USR1"), Some(Signal::SIGUSR1));
        assert_eq!(signal_by_ssh_name("USR2"), Some(Signal::SIGUSR2));
        assert_eq!(
            signal_by_ssh_name("SIGINT"),
            None,
            "SSH names have no SIG prefix"
        );
        assert_eq!(signal_by_ssh_name("STOP"), None);
        assert_eq!(signal_by_ssh_name(""), None);
    }

    #[test]
    fn a_process_of_the_same_pid_namespace_is_signalled() {
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let me = std::process::id();
        signal_process(child.id(), me, Signal::SIGTERM).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(Signal::SIGTERM as i32));
    }

    #[test]
    fn a_process_that_is_gone_is_not_signalled() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let err = signal_process(pid, std::process::id(), Signal::SIGTERM).unwrap_err();
        assert!(matches!(err, SignalError::Namespace { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn connecting_in_our_own_namespace_reaches_a_local_listener() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connect = connect_in_netns(
            std::process::id(),
            vec!["127.0.0.1".parse().unwrap()],
            port,
            Duration::from_secs(5),
        );
        let (stream, accepted) = tokio::join!(connect, listener.accept());
        assert_eq!(
            stream.unwrap().local_addr().unwrap(),
            accepted.unwrap().1,
            "the same connection"
        );
    }
}
