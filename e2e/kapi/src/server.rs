//! The API server and its etcd as child processes.

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::{KapiError, Tools};

/// How requests are authorised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Authorization {
    /// Every request is an admin's (kapi's default).
    #[default]
    AlwaysAllow,
    /// Bearer tokens authenticate and the stored RBAC objects authorise (`kapi-admin` is in
    /// `system:masters`; other tokens come from [`KapiOptions::tokens`]).
    Rbac,
}

/// A static bearer token (kube-apiserver's token file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    /// The bearer token.
    pub token: String,
    /// The user it authenticates as, e.g. `system:serviceaccount:ns:name`.
    pub user: String,
    /// The user's groups.
    pub groups: Vec<String>,
}

impl Token {
    /// A token for the ServiceAccount `name` in `namespace`, in the groups Kubernetes gives
    /// ServiceAccounts.
    pub fn service_account(token: &str, namespace: &str, name: &str) -> Token {
        Token {
            token: token.to_owned(),
            user: format!("system:serviceaccount:{namespace}:{name}"),
            groups: vec![
                "system:serviceaccounts".to_owned(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".to_owned(),
            ],
        }
    }
}

/// How to run the server.
#[derive(Debug, Clone, Default)]
pub struct KapiOptions {
    /// Authorisation mode.
    pub authorization: Authorization,
    /// Extra tokens (RBAC mode).
    pub tokens: Vec<Token>,
    /// Extra kapi flags.
    pub extra_args: Vec<String>,
}

/// A copy of etcd's data directory.
#[derive(Debug)]
pub struct EtcdBackup {
    dir: PathBuf,
}

/// The admin's bearer token.
const ADMIN_TOKEN: &str = "kapi-admin";
/// How long a process may take to become ready: seconds on an idle machine, but the test
/// runner starts several at once on a 2-core CI host, where one took over 60 s (2026-11-30).
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// A running API server and its etcd; dropping it stops both and removes the run directory
/// (kept when `KVGATE_KEEP_KAPI` is set).
#[derive(Debug)]
pub struct Kapi {
    tools: Tools,
    options: KapiOptions,
    dir: PathBuf,
    etcd_port: u16,
    etcd_peer_port: u16,
    api_port: u16,
    etcd: Option<Child>,
    apiserver: Option<Child>,
}

impl Kapi {
    /// Starts etcd and the API server on free loopback ports and waits until `/readyz` answers.
    pub async fn start(options: KapiOptions) -> Result<Kapi, KapiError> {
        let tools = Tools::locate()?;
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvgate-kapi-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("certs"))
            .map_err(|e| KapiError::io(format!("create {}", dir.display()), e))?;
        let mut kapi = Kapi {
            tools,
            options,
            etcd_port: free_port()?,
            etcd_peer_port: free_port()?,
            api_port: free_port()?,
            dir,
            etcd: None,
            apiserver: None,
        };
        kapi.write_files()?;
        kapi.start_etcd().await?;
        kapi.start_apiserver().await?;
        tracing::info!(server = %kapi.server_url(), dir = %kapi.dir.display(), "test API server ready");
        Ok(kapi)
    }

    /// The tools the server was started with (and the clients tests drive).
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// The run directory (logs, certificates, kubeconfigs, etcd data).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.api_port)
    }

    /// The API server's self-signed certificate (the kubeconfigs' CA).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("certs/apiserver.crt")
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// Writes a kubeconfig authenticating with `token` (one of [`KapiOptions::tokens`]) as
    /// `<dir>/<name>.kubeconfig` and returns its path.
    pub fn kubeconfig_for(&self, name: &str, token: &str) -> Result<PathBuf, KapiError> {
        let path = self.dir.join(format!("{name}.kubeconfig"));
        write_file(&path, &self.kubeconfig_text(token, true))?;
        Ok(path)
    }

    /// A client with the admin's kubeconfig.
    pub async fn client(&self) -> Result<kube::Client, KapiError> {
        client_for(&self.kubeconfig()).await
    }

    /// Stops the API server (SIGTERM, then SIGKILL after 5 s); etcd keeps running.
    pub fn stop_apiserver(&mut self) {
        stop(self.apiserver.take());
    }

    /// Starts the API server again on the same port and waits for `/readyz`.
    pub async fn start_apiserver(&mut self) -> Result<(), KapiError> {
        let mut args = vec![
            format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_port),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={}", self.api_port),
            format!("--cert-dir={}", self.dir.join("certs").display()),
            format!(
                "--kubeconfig={}",
                self.dir.join("loopback.kubeconfig").display()
            ),
            "--enable-priority-and-fairness=false".to_owned(),
            "--disable-admission-plugins=MutatingAdmissionPolicy,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook".to_owned(),
        ];
        match self.options.authorization {
            Authorization::AlwaysAllow => args.push("--authorization=AlwaysAllow".to_owned()),
            Authorization::Rbac => {
                args.push("--authorization=RBAC".to_owned());
                args.push(format!(
                    "--token-auth-file={}",
                    self.dir.join("tokens.csv").display()
                ));
            }
        }
        args.extend(self.options.extra_args.iter().cloned());
        let log = self.dir.join("kapi.log");
        let child = spawn(&self.tools.kapi, &args, &log)?;
        self.apiserver = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut client = None;
        loop {
            // kapi writes its self-signed certificate (the kubeconfig's CA) as it starts.
            if client.is_none() && self.ca_file().is_file() {
                client = client_for(&self.kubeconfig()).await.ok();
            }
            if let Some(client) = &client {
                let req = http::Request::get("/readyz")
                    .body(Vec::new())
                    .map_err(|e| {
                        KapiError::io("build /readyz request", std::io::Error::other(e))
                    })?;
                if client.request_text(req).await.is_ok() {
                    return Ok(());
                }
            }
            if exited(&mut self.apiserver) {
                return Err(KapiError::Exited { what: "kapi", log });
            }
            if Instant::now() > deadline {
                return Err(KapiError::NotReady {
                    what: "kapi",
                    seconds: READY_TIMEOUT.as_secs(),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops etcd (SIGTERM, then SIGKILL after 5 s); the API server keeps running, failing.
    pub fn stop_etcd(&mut self) {
        stop(self.etcd.take());
    }

    /// Starts etcd again on the same ports over its data directory and waits until healthy.
    pub async fn start_etcd(&mut self) -> Result<(), KapiError> {
        let client = format!("http://127.0.0.1:{}", self.etcd_port);
        let peer = format!("http://127.0.0.1:{}", self.etcd_peer_port);
        let args = vec![
            "--name=kapi".to_owned(),
            format!("--data-dir={}", self.dir.join("etcd").display()),
            format!("--listen-client-urls={client}"),
            format!("--advertise-client-urls={client}"),
            format!("--listen-peer-urls={peer}"),
            format!("--initial-advertise-peer-urls={peer}"),
            format!("--initial-cluster=kapi={peer}"),
            "--unsafe-no-fsync".to_owned(),
            "--log-level=warn".to_owned(),
        ];
        let log = self.dir.join("etcd.log");
        self.etcd = Some(spawn(&self.tools.etcd, &args, &log)?);
        let deadline = Instant::now() + READY_TIMEOUT;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.etcd_port));
        loop {
            if etcd_healthy(addr) {
                return Ok(());
            }
            if exited(&mut self.etcd) {
                return Err(KapiError::Exited { what: "etcd", log });
            }
            if Instant::now() > deadline {
                return Err(KapiError::NotReady {
                    what: "etcd",
                    seconds: READY_TIMEOUT.as_secs(),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Copies etcd's data: etcd is stopped for the copy and started again.
    pub async fn backup_etcd(&mut self) -> Result<EtcdBackup, KapiError> {
        self.stop_etcd();
        let backup = EtcdBackup {
            dir: self.dir.join(format!(
                "etcd-backup-{}",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
            )),
        };
        copy_dir(&self.dir.join("etcd"), &backup.dir)?;
        self.start_etcd().await?;
        Ok(backup)
    }

    /// Restores etcd's data from `backup` as an operator would after losing the cluster's
    /// store: the API server and etcd stop, the data is replaced, both start again. Resource
    /// versions go back to the backup's.
    pub async fn restore_etcd(&mut self, backup: &EtcdBackup) -> Result<(), KapiError> {
        self.stop_apiserver();
        self.stop_etcd();
        let data = self.dir.join("etcd");
        std::fs::remove_dir_all(&data)
            .map_err(|e| KapiError::io(format!("remove {}", data.display()), e))?;
        copy_dir(&backup.dir, &data)?;
        self.start_etcd().await?;
        self.start_apiserver().await
    }

    fn write_files(&self) -> Result<(), KapiError> {
        let mut tokens = format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n");
        for t in &self.options.tokens {
            let _ = writeln!(
                tokens,
                "{},{},{},\"{}\"",
                t.token,
                t.user,
                t.user,
                t.groups.join(",")
            );
        }
        write_file(&self.dir.join("tokens.csv"), &tokens)?;
        write_file(
            &self.dir.join("loopback.kubeconfig"),
            &self.kubeconfig_text(ADMIN_TOKEN, false),
        )?;
        write_file(
            &self.dir.join("kubeconfig"),
            &self.kubeconfig_text(ADMIN_TOKEN, true),
        )
    }

    fn kubeconfig_text(&self, token: &str, verify: bool) -> String {
        let tls = if verify {
            format!("certificate-authority: {}", self.ca_file().display())
        } else {
            "insecure-skip-tls-verify: true".to_owned()
        };
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: kapi\n  cluster:\n    server: {}\n    {tls}\nusers:\n- name: user\n  user: {{token: {token}}}\ncontexts:\n- name: kapi\n  context: {{cluster: kapi, user: user, namespace: default}}\ncurrent-context: kapi\n",
            self.server_url()
        )
    }
}

impl Drop for Kapi {
    fn drop(&mut self) {
        self.stop_apiserver();
        self.stop_etcd();
        if std::env::var_os("KVGATE_KEEP_KAPI").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A kube client from a kubeconfig file.
pub(crate) async fn client_for(path: &Path) -> Result<kube::Client, KapiError> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| KapiError::Kubeconfig {
        path: path.to_owned(),
        source,
    })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| KapiError::Kubeconfig {
            path: path.to_owned(),
            source,
        })?;
    Ok(kube::Client::try_from(config)?)
}

fn free_port() -> Result<u16, KapiError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| KapiError::io("pick a free port", e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| KapiError::io("pick a free port", e))
}

fn write_file(path: &Path, text: &str) -> Result<(), KapiError> {
    std::fs::write(path, text).map_err(|e| KapiError::io(format!("write {}", path.display()), e))
}

fn spawn(program: &Path, args: &[String], log: &Path) -> Result<Child, KapiError> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| KapiError::io(format!("open {}", log.display()), e))?;
    let err = out
        .try_clone()
        .map_err(|e| KapiError::io(format!("open {}", log.display()), e))?;
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| KapiError::io(format!("start {}", program.display()), e))
}

/// Whether the child has exited (or is gone).
fn exited(child: &mut Option<Child>) -> bool {
    match child {
        Some(c) => !matches!(c.try_wait(), Ok(None)),
        None => true,
    }
}

/// SIGTERM, a wait of up to 5 s, then SIGKILL.
fn stop(child: Option<Child>) {
    let Some(mut child) = child else { return };
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// etcd's `/health` says `"health":"true"`.
fn etcd_healthy(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

fn copy_dir(from: &Path, to: &Path) -> Result<(), KapiError> {
    std::fs::create_dir_all(to)
        .map_err(|e| KapiError::io(format!("create {}", to.display()), e))?;
    let entries = std::fs::read_dir(from)
        .map_err(|e| KapiError::io(format!("read {}", from.display()), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| KapiError::io(format!("read {}", from.display()), e))?;
        let path = entry.path();
        let target = to.join(entry.file_name());
        if path.is_dir() {
            copy_dir(&path, &target)?;
        } else {
            std::fs::copy(&path, &target)
                .map_err(|e| KapiError::io(format!("copy {}", path.display()), e))?;
        }
    }
    Ok(())
}
