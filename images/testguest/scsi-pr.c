/* scsi-pr DEV KEY: the guest's SCSI persistent reservation on DEV, sent as a clustered guest's fencing
 * agent sends it (SG_IO, as sg_persist does): PERSISTENT RESERVE OUT REGISTER of KEY (hex), RESERVE of type
 * Write Exclusive with it, then PERSISTENT RESERVE IN READ KEYS and READ RESERVATION. Prints one line:
 *   register=S reserve=S keys=N first=KEY holder=KEY|- type=T
 * S is "ok" or the SCSI status in hex (0x18 RESERVATION CONFLICT, 0x2 CHECK CONDITION), or "sg-error"
 * when the kernel refused the ioctl (no SCSI passthrough: a disk that is not a lun).
 *
 * Freestanding (no libc): built by build.sh with the host's gcc alone, a few KiB in the initramfs. */

typedef unsigned long u64;
typedef unsigned char u8;

static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile ("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}
#define SYS_write 1
#define SYS_open 2
#define SYS_ioctl 16
#define SYS_exit 60
#define O_RDWR 2
#define SG_IO 0x2285

/* struct sg_io_hdr from <scsi/sg.h>, x86_64 layout */
struct sg_io_hdr {
    int interface_id, dxfer_direction;
    unsigned char cmd_len, mx_sb_len;
    unsigned short iovec_count;
    unsigned int dxfer_len;
    void *dxferp;
    unsigned char *cmdp, *sbp;
    unsigned int timeout, flags;
    int pack_id;
    void *usr_ptr;
    unsigned char status, masked_status, msg_status, sb_len_wr;
    unsigned short host_status, driver_status;
    int resid;
    unsigned int duration, info;
};
#define SG_DXFER_TO_DEV (-2)
#define SG_DXFER_FROM_DEV (-3)

static char out[256];
static int len;
static void put(const char *s) { while (*s && len < (int)sizeof out - 1) out[len++] = *s++; }
static void hex(u64 v) {
    char b[17]; int i = 16; b[16] = 0;
    do { b[--i] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v);
    put(b + i);
}
static void zero(u8 *p, int n) { while (n--) *p++ = 0; }
static void put64(u8 *p, u64 v) { for (int i = 7; i >= 0; i--) { p[i] = v & 0xff; v >>= 8; } }
static u64 get64(const u8 *p) { u64 v = 0; for (int i = 0; i < 8; i++) v = v << 8 | p[i]; return v; }

/* returns -1 when the ioctl failed, else the SCSI status (host/driver errors as 0x100) */
static int run(int fd, u8 *cdb, u8 *buf, int buflen, int dir) {
    u8 sense[32];
    struct sg_io_hdr io;
    zero((u8 *)&io, sizeof io);
    io.interface_id = 'S'; io.cmdp = cdb; io.cmd_len = 10; io.dxferp = buf; io.dxfer_len = buflen;
    io.dxfer_direction = dir; io.sbp = sense; io.mx_sb_len = sizeof sense; io.timeout = 20000;
    if (sys3(SYS_ioctl, fd, SG_IO, (long)&io) < 0) return -1;
    if (io.host_status || (io.driver_status & ~0x08)) return 0x100;
    return io.status;
}
static void status(const char *name, int st) {
    put(name);
    if (st == 0) put("ok");
    else if (st < 0) put("sg-error");
    else { put("0x"); hex(st); }
}

void _start_c(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    if (argc != 3) { put("usage: scsi-pr DEV KEY\n"); sys3(SYS_write, 2, (long)out, len); sys3(SYS_exit, 2, 0, 0); }
    u64 key = 0;
    for (char *c = argv[2]; *c; c++) key = key << 4 | (u64)(*c <= '9' ? *c - '0' : (*c | 32) - 'a' + 10);
    long fd = sys3(SYS_open, (long)argv[1], O_RDWR, 0);
    if (fd < 0) { put("open-failed\n"); sys3(SYS_write, 1, (long)out, len); sys3(SYS_exit, 1, 0, 0); }

    u8 param[24], buf[64];
    zero(param, sizeof param); put64(param + 8, key);              /* service action reservation key */
    u8 reg[10] = {0x5f, 0x00, 0, 0, 0, 0, 0, 0, 24, 0};            /* PR OUT, REGISTER */
    status("register=", run(fd, reg, param, 24, SG_DXFER_TO_DEV));
    zero(param, sizeof param); put64(param, key);                  /* reservation key */
    u8 res[10] = {0x5f, 0x01, 0x01, 0, 0, 0, 0, 0, 24, 0};         /* PR OUT, RESERVE, Write Exclusive */
    status(" reserve=", run(fd, res, param, 24, SG_DXFER_TO_DEV));

    u8 keys[10] = {0x5e, 0x00, 0, 0, 0, 0, 0, 0, 64, 0};           /* PR IN, READ KEYS */
    zero(buf, sizeof buf);
    int st = run(fd, keys, buf, 64, SG_DXFER_FROM_DEV);
    unsigned n = st == 0 ? (unsigned)(buf[4] << 24 | buf[5] << 16 | buf[6] << 8 | buf[7]) / 8 : 0;
    put(" keys="); hex(n); put(" first="); hex(n ? get64(buf + 8) : 0);
    u8 rsv[10] = {0x5e, 0x01, 0, 0, 0, 0, 0, 0, 64, 0};            /* PR IN, READ RESERVATION */
    zero(buf, sizeof buf);
    st = run(fd, rsv, buf, 64, SG_DXFER_FROM_DEV);
    int held = st == 0 && (buf[4] | buf[5] | buf[6] | buf[7]);     /* additional length 0: none */
    put(" holder=");
    if (held) hex(get64(buf + 8)); else put("-");
    put(" type="); hex(held ? buf[21] & 15 : 0);
    put("\n");
    sys3(SYS_write, 1, (long)out, len);
    sys3(SYS_exit, 0, 0, 0);
}

__asm__(".globl _start\n_start:\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call _start_c\n  hlt\n");
