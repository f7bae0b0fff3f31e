//! The handshake's descriptor passing over a Unix stream socket (`SCM_RIGHTS`), on tokio's
//! sockets: one byte carries the segment's descriptor.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::protocol::HANDSHAKE;

/// Receives the handshake byte and the descriptor attached to it.
pub async fn recv_fd(stream: &UnixStream) -> io::Result<OwnedFd> {
    loop {
        stream.readable().await?;
        let got = stream.try_io(Interest::READABLE, || {
            let mut byte = [0u8; 1];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let msg = rustix::net::recvmsg(
                stream,
                &mut [IoSliceMut::new(&mut byte)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(io::Error::from)?;
            // Take the first descriptor; any others are closed as the iterator drops them.
            let mut fd = None;
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = message {
                    for f in fds {
                        fd.get_or_insert(f);
                    }
                }
            }
            Ok((msg.bytes, byte[0], fd))
        });
        match got {
            Ok((0, _, _)) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok((_, b, Some(fd))) if b == HANDSHAKE => return Ok(fd),
            Ok((_, b, None)) if b == HANDSHAKE => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "handshake without a segment descriptor",
                ));
            }
            Ok((_, b, _)) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected the handshake byte {HANDSHAKE:#04x}, got {b:#04x}"),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Sends the handshake byte with `fd` attached.
pub async fn send_fd(stream: &UnixStream, fd: impl AsFd) -> io::Result<()> {
    let fds = [fd.as_fd()];
    loop {
        stream.writable().await?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            control.push(SendAncillaryMessage::ScmRights(&fds));
            rustix::net::sendmsg(
                stream,
                &[IoSlice::new(&[HANDSHAKE])],
                &mut control,
                SendFlags::empty(),
            )
            .map_err(io::Error::from)
        });
        match sent {
            Ok(1) => return Ok(()),
            Ok(_) => return Err(io::ErrorKind::WriteZero.into()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{Segment, create};

    #[tokio::test]
    async fn a_segment_crosses_the_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let fd = create("seg", 16).unwrap();
        Segment::new(fd.try_clone().unwrap(), 16, 16)
            .unwrap()
            .write(0, b"shared")
            .unwrap();
        send_fd(&a, &fd).await.unwrap();
        let got = Segment::new(recv_fd(&b).await.unwrap(), 16, 16).unwrap();
        assert_eq!(&got.read(0, 6).unwrap()[..], b"shared");
    }

    #[tokio::test]
    async fn a_plain_byte_or_wrong_byte_is_refused() {
        use tokio::io::AsyncWriteExt as _;
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[HANDSHAKE]).await.unwrap();
        assert_eq!(
            recv_fd(&b).await.unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"x").await.unwrap();
        assert_eq!(
            recv_fd(&b).await.unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        drop(a);
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        assert_eq!(
            recv_fd(&b).await.unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
