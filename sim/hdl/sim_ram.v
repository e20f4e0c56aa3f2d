// Byte-writable RAM for Verilator-built simulations: NR read and NW byte-masked write
// ports (two of each per memory channel, for the channel's unaligned beats) and one
// word-wide backdoor for the testbench. Port p of a kind is the p-th slice of the packed
// vectors. Written in Verilog because Amaranth elaborates a memory's initial contents
// word by word, which for megabytes costs more than the whole rest of a multi-node build.
module fpgaccl_sim_ram #(parameter WIDTH = 64, parameter AW = 10,
                         parameter NR = 2, parameter NW = 2) (
    input  wire                      clk,
    input  wire [NR*AW-1:0]          ra,
    input  wire [NR-1:0]             re,
    output reg  [NR*WIDTH-1:0]       rd,
    input  wire [NW*AW-1:0]          wa,
    input  wire [NW*WIDTH/8-1:0]     we,
    input  wire [NW*WIDTH-1:0]       wd,
    input  wire [AW-1:0]             bra, output reg [WIDTH-1:0] brd,
    input  wire [AW-1:0]             bwa, input wire bwe, input wire [WIDTH-1:0] bwd
);
    reg [WIDTH-1:0] mem [0:(1 << AW) - 1];
    integer p, i;
    always @(posedge clk) begin
        for (p = 0; p < NR; p = p + 1)
            if (re[p]) rd[p*WIDTH +: WIDTH] <= mem[ra[p*AW +: AW]];
        brd <= mem[bra];
        for (p = 0; p < NW; p = p + 1)
            for (i = 0; i < WIDTH / 8; i = i + 1)
                if (we[p*WIDTH/8 + i]) mem[wa[p*AW +: AW]][i*8 +: 8] <= wd[p*WIDTH + i*8 +: 8];
        if (bwe) mem[bwa] <= bwd;
    end
endmodule
